#include "dhp/dist/transport.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "dhp/core/error.h"

namespace dhp::dist {
namespace {

std::vector<std::string> split_names(const std::string& list) {
  std::vector<std::string> out;
  size_t start = 0;
  for (size_t i = 0; i <= list.size(); ++i) {
    if (i == list.size() || list[i] == ',') {
      if (i > start) out.push_back(list.substr(start, i - start));
      start = i + 1;
    }
  }
  return out;
}

std::string ipv4_text(const in_addr& a) {
  char buf[INET_ADDRSTRLEN] = {};
  inet_ntop(AF_INET, &a, buf, sizeof(buf));
  return buf;
}

// name: IPv4 address, for each interface that has one.
std::vector<std::pair<std::string, std::string>> interfaces_with_ipv4() {
  std::vector<std::pair<std::string, std::string>> out;
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) return out;
  for (ifaddrs* i = list; i; i = i->ifa_next) {
    if (i->ifa_addr && i->ifa_addr->sa_family == AF_INET)
      out.emplace_back(i->ifa_name, ipv4_text(reinterpret_cast<sockaddr_in*>(i->ifa_addr)->sin_addr));
  }
  freeifaddrs(list);
  return out;
}

}  // namespace

std::string Transport::describe() const {
  if (interfaces.empty()) return "address " + address;
  std::string s = interfaces.size() == 1 ? "interface " : "interfaces ";
  for (size_t i = 0; i < interfaces.size(); ++i) {
    const auto a = interface_address(interfaces[i]);
    s += (i ? ", " : "") + interfaces[i] + (a.empty() ? "" : " (" + a + ")");
  }
  return s;
}

bool is_loopback(const std::string& ipv4) { return ipv4.rfind("127.", 0) == 0; }

std::string interface_address(const std::string& name) {
  for (const auto& [n, a] : interfaces_with_ipv4())
    if (n == name) return a;
  return "";
}

std::string local_address_towards(const std::string& host) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* res = nullptr;
  const int rc = getaddrinfo(host.c_str(), "9", &hints, &res);
  DHP_CHECK(rc == 0 && res, "MASTER_ADDR=", host, " does not resolve to an IPv4 address: ", gai_strerror(rc));
  // Connecting a UDP socket sends nothing; it asks the kernel for the route and its source.
  const int fd = ::socket(AF_INET, SOCK_DGRAM, 0);
  sockaddr_in local{};
  socklen_t len = sizeof(local);
  const bool ok = fd >= 0 && ::connect(fd, res->ai_addr, res->ai_addrlen) == 0 &&
                  ::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) == 0;
  const int err = errno;
  if (fd >= 0) ::close(fd);
  freeaddrinfo(res);
  DHP_CHECK(ok, "no route from this host to MASTER_ADDR=", host, ": ", std::strerror(err));
  return ipv4_text(local.sin_addr);
}

Transport choose_transport(const WorkerEnv& env, const std::string& ifname, const std::string& ifname_source) {
  Transport t;
  if (!ifname.empty()) {
    const auto have = interfaces_with_ipv4();
    for (const auto& name : split_names(ifname)) {
      bool found = false;
      for (const auto& h : have) found = found || h.first == name;
      if (!found) {
        std::string names;
        for (const auto& h : have) names += (names.empty() ? "" : ", ") + h.first + " (" + h.second + ")";
        DHP_FAIL(ifname_source, "=", ifname, ": this host has no interface '", name,
                 "' with an IPv4 address; it has ", names.empty() ? "none" : names);
      }
      t.interfaces.push_back(name);
    }
    return t;
  }
  if (env.single_host()) return t;  // loopback
  t.address = local_address_towards(env.master_addr);
  DHP_CHECK(!is_loopback(t.address), "MASTER_ADDR=", env.master_addr, " is this host's loopback, but the job spans hosts (",
            env.local_world, " of its ", env.world, " ranks here): set MASTER_ADDR to an address of rank 0's host that "
            "every host reaches, or name the interface with GLOO_SOCKET_IFNAME");
  return t;
}

Transport process_transport(const WorkerEnv& env, const std::string& config_ifname) {
  if (const char* v = std::getenv("GLOO_SOCKET_IFNAME"); v && *v) return choose_transport(env, v, "GLOO_SOCKET_IFNAME");
  return choose_transport(env, config_ifname, "parallel.socket_ifname");
}

}  // namespace dhp::dist
