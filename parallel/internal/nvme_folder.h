// A rank's folder under an offload section's nvme_path (internal to
// parallel/): `nvme_path`/remat-<kind>/rank<R>/, with an exclusive lock on
// its `lock` file held while the object lives, so that a second job given
// the same nvme_path is refused at start (naming the folder). The files a
// run of this rank writes there are named rank<R>.<kind>...; those a crashed
// run left are removed under the lock, and said. Anything else in the folder
// is the user's and stays. While the object lives, a signal that ends the
// rank from outside (SIGTERM, SIGINT: a Ctrl-C at mpirun, which then stops
// the ranks with SIGTERM; SIGUSR1 and SIGUSR2, which mpirun forwards; SIGHUP,
// SIGQUIT, SIGXCPU, SIGPIPE) and a disk error remat turns into an exit
// (nvme_tensor_file.cc's SIGBUS) remove this rank's file before the process
// ends (remove_on_exit_now); a kill -9 leaves it to the next run's sweep. A handler the program had for one of those signals is
// called after the removal (either kind, with its mask and SA_RESTART kept),
// and decides what follows; without one the signal ends the process.
// Rank 0, given the job's `world_size`, also removes what a crashed run of
// more ranks left in the folders of ranks this job does not have
// (rank<K>/, K >= world_size), each under that folder's lock (a folder
// locked by a live job is left alone).
#pragma once

#include <string>

namespace remat::parallel::internal {

class NvmeFolder {
 public:
  // `section`: the JSON section named in errors ("offload_optimizer" or
  // "offload_param"); `kind`: "optimizer" or "parameters"; `holds`: what
  // each rank keeps there, for the errors ("its optimizer state").
  // `world_size`: the job's ranks (0: unknown, nothing beyond this rank's
  // folder is swept).
  NvmeFolder(const std::string& nvme_path, int rank, const std::string& section, const std::string& kind,
             const std::string& holds, int world_size = 0);
  ~NvmeFolder();
  NvmeFolder(const NvmeFolder&) = delete;
  NvmeFolder& operator=(const NvmeFolder&) = delete;

  const std::string& path() const { return path_; }
  // The name of this rank's file of `kind` in the folder, rank<R>.<kind>.
  const std::string& file_name() const { return file_name_; }

 private:
  std::string path_, file_name_;
  int fd_ = -1;
  int slot_ = -1;  // in the table of files removed on a signal
};

// Removes every live folder's file (async-signal-safe: for a signal handler
// about to end the process).
void remove_on_exit_now();

}  // namespace remat::parallel::internal
