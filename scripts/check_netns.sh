#!/usr/bin/env bash
# Can this machine make the network namespaces that tests/test_hosts.cpp uses as hosts?
# Prints one line for CI's summary; always exits 0 (the tests skip themselves when not).
name="dhp-probe-$$"
if out=$(ip netns add "$name" 2>&1); then
  ip netns del "$name" 2>/dev/null
  echo "multi-host tests (tests/test_hosts.cpp): run, on two network namespaces"
else
  echo "multi-host tests (tests/test_hosts.cpp): SKIPPED, network namespaces cannot be made here: ${out:-ip not found}"
fi
