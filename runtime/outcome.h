// Agreeing on the outcome of each rank's part of a collective operation.
//
// An operation whose ranks each check or write something of their own (a
// save's rank files, a lock only rank 0 takes) fails on some ranks only; if
// those ranks throw while the others go on to the operation's next
// collective, the others wait there until the communication timeout, and a
// program that catches the error ("resume if there is a save, else start
// fresh") hangs. Each rank runs its part inside agree_on_outcome instead:
//
//   agree_on_outcome(*world, "the save of step 3", [&] { write_my_rank_file(); });
//   world->allGather(...);  // reached by every rank, or by none
#pragma once

#include <functional>
#include <string>

namespace remat {

class Communicator;

// Runs `part` (this rank's part of an operation: local checks and writes,
// no collective) and agrees on its outcome over `group` (one all-gather, and
// a second with the messages when something failed). Returns on every rank
// when `part` succeeded on every rank; otherwise every rank throws the same
// error, a ConfigError if the lowest failing rank's was one, else an Error:
// that rank's message followed by "(WHAT failed on rank R of N; every rank
// stops with this error)", or each distinct message with its ranks when they
// differ. A CommError from `part` is rethrown at once (the group cannot be
// relied on to agree).
void agree_on_outcome(Communicator& group, const std::string& what, const std::function<void()>& part);

}  // namespace remat
