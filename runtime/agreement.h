// Checks that every rank of a job runs with the same settings.
//
// Ranks configured differently (an MPMD launch line, per-node copies of a
// config file that drifted) otherwise hang in a collective that only some of
// them make, or train diverging replicas without a word. A job calls this
// once at start, before anything whose shape depends on the settings:
//
//   std::map<std::string, std::string> settings = flatten(config) + flags;
//   remat::require_same_settings(*world, settings, "configuration");
#pragma once

#include <map>
#include <string>

namespace remat {

class Communicator;

// Collective over `group`: returns when every rank holds the same `settings`
// (key -> value); otherwise throws a ConfigError, on every rank, naming each
// key that differs and which ranks hold which value, so no rank goes on alone.
// `what` names the settings in the message ("configuration and flags").
void require_same_settings(Communicator& group, const std::map<std::string, std::string>& settings,
                           const std::string& what);

}  // namespace remat
