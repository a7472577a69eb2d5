#include "checkpointing/region_options.h"

#include "runtime/communicator.h"

namespace remat {

bool InputStorageOptions::partitioned() const {
  return partition_group != nullptr && partition_group->size() > 1;
}

}  // namespace remat
