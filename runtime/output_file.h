// The one rule every file remat writes at a path the user gave follows
// (--metrics, --memory-trace, --export, the estimator's --json, and the same
// files reached through the library), checked before anything runs:
//
//   check_output_file({"--export", path, "model.pt"});   // a ConfigError if not
//   check_distinct_outputs({{"--metrics", m}, {"--export", e}});
//
// A path is usable when it is a regular file, or a new one in an existing
// folder this process can create files in. A directory, a device node, a
// fifo, a socket or a symbolic link is refused: the files are written beside
// the path and renamed over it, which would replace the node or the link (as
// root, even /dev/null).
#pragma once

#include <string>
#include <utility>
#include <vector>

namespace remat {

struct OutputFile {
  std::string flag;  // what the user gave it as ("--metrics", "remat::Engine::export_model")
  std::string path;
  std::string example = "out.json";  // a file name suggested inside a directory given by mistake
};

// A ConfigError naming `out.flag`, what the path is and what to change,
// unless a file can be written at `out.path` (a probe of a unique name beside
// it is created and removed; the path itself is not touched).
void check_output_file(const OutputFile& out);

// What `path` is when it exists and is not a regular file ("a directory", "a
// symbolic link", "a fifo", ...), "" when it is one or does not exist.
std::string not_a_regular_file(const std::string& path);

// Where `path` leads, for comparing two outputs: the real path of its folder
// (through `..` and symbolic links) and its name; "" when its folder does not
// resolve. Two spellings of one file compare equal (hard links too, by
// device and inode, where the file exists).
std::string output_identity(const std::string& path);

// A ConfigError naming both flags when two of `outputs` (flag, path) are one
// file, so that one output would overwrite the other. Empty paths are skipped.
void check_distinct_outputs(const std::vector<std::pair<std::string, std::string>>& outputs);

// `path` for a message, cut in the middle when longer than 240 characters
// (its first 80 and last 120 kept, with how many were left out), so that an
// error about a path of megabytes stays readable and still names the file.
std::string shown_path(const std::string& path);

// A temporary file of a unique name beside `path` (PATH.remat-tmp.XXXXXX),
// open, with the mode a new file gets here: an existing PATH.tmp, whoever's,
// is left alone. Returns the descriptor (-1 with errno set) and the name in `name`.
// The file is locked (flock) while the descriptor is open, so the writer
// renames it over `path` before closing it; temporaries of `path` that no
// process holds (a writer killed half-way left them) are removed first, each
// named in a log line.
int open_temporary_beside(const std::string& path, std::string& name);

// Removes the PATH.remat-tmp.XXXXXX files beside `path` (six letters or
// digits) that no writer holds and that have no other name (a hard link is
// someone's data); returns how many.
int remove_stale_temporaries(const std::string& path);

// What an output may not be: a file the run reads, or a path inside a folder
// the run reads or keeps (its saves). `folder`: `path` is a folder whose
// inside is protected too: all of it, or only the entries `owned` names (a
// name, or a prefix ending in '*'), so that a file of the user's may sit
// beside a save (saves/model.pt) while the save's own files may not be hit.
struct RunInput {
  std::string what;  // "--config", "data.path", "--resume", "--save-dir"
  std::string path;
  bool folder = false;
  std::string role = "which this run reads";  // of a folder: what it holds, for the message
  std::vector<std::string> owned;             // of a folder: its protected entries; empty: every one
  // What writing into it would do, for the message.
  std::string harm = "so writing it would damage them";
};

// The entries of a save folder remat owns (its lock, `latest`, step folders
// and what a save writes before they are complete): RunInput::owned.
const std::vector<std::string>& save_folder_entries();

// A ConfigError naming the output's flag, the input and what to change when
// an output (flag, path) of `outputs` is one of `inputs`' files, or is one of
// their folders or lies inside one (in an entry it owns), through `..`,
// symbolic links and hard links; paths that do not exist yet are compared by
// where they would be. Empty paths are skipped.
void check_outputs_spare_inputs(const std::vector<std::pair<std::string, std::string>>& outputs,
                                const std::vector<RunInput>& inputs);

// A folder an output writes in (--save-dir, a sharded --export) and the
// entries in it that its writer replaces or removes.
struct OutputFolder {
  std::string flag;                // "--save-dir"
  std::string path;
  std::vector<std::string> owned;  // as RunInput::owned; empty: every entry
  std::string does;                // what it does to them, for the message
};

// The converse of check_outputs_spare_inputs: a ConfigError naming the
// input, the output folder and what to change when one of `inputs` lies
// strictly inside `out` in an entry it owns, or (a file) has a hard link
// there, through `..` and symbolic links: writing the output would replace or
// remove what the run reads. Empty paths are skipped.
void check_inputs_outside(const OutputFolder& out, const std::vector<RunInput>& inputs);

}  // namespace remat
