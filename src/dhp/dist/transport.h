// Where a job's Gloo groups listen and what they connect over (torch-free).
//
// A job whose ranks all run on one host keeps its groups on loopback (127.0.0.1). A job that
// spans hosts uses the interfaces named by GLOO_SOCKET_IFNAME (the variable torch users
// already set per host; comma-separated) or parallel.socket_ifname (the same for every host),
// else this host's address on the route to MASTER_ADDR, as the kernel would choose it to
// reach rank 0's host. The store itself is c10d's TCPStore on MASTER_ADDR:MASTER_PORT.
#pragma once

#include <string>
#include <vector>

#include "dhp/dist/launcher_env.h"

namespace dhp::dist {

struct Transport {
  std::vector<std::string> interfaces;  // when set: Gloo devices on these interfaces
  std::string address = "127.0.0.1";    // otherwise: a Gloo device bound to this address
  // "interface eth1 (10.0.0.2)" or "address 10.0.0.2", for logs.
  std::string describe() const;
};

// The transport of a rank described by `env`. `ifname`: the interfaces asked for ("" =
// none; GLOO_SOCKET_IFNAME wins over parallel.socket_ifname, see process_transport). Throws
// dhp::Error naming the interface that does not exist (listing those that do) or the
// MASTER_ADDR that does not resolve, or that is loopback on a job spanning hosts.
Transport choose_transport(const WorkerEnv& env, const std::string& ifname, const std::string& ifname_source);
// choose_transport with GLOO_SOCKET_IFNAME from the environment, else `config_ifname`
// (parallel.socket_ifname).
Transport process_transport(const WorkerEnv& env, const std::string& config_ifname);

// This host's IPv4 address that the kernel uses to reach `host` (a name or an address; no
// packet is sent). Throws dhp::Error when it does not resolve or is unreachable.
std::string local_address_towards(const std::string& host);
// This host's IPv4 address on interface `name`, or "" when it has none.
std::string interface_address(const std::string& name);
bool is_loopback(const std::string& ipv4);

}  // namespace dhp::dist
