#pragma once
// A storage whose data is gone but whose tensors live on (a unit's freed full
// buffer: the parameters stay views of it) should make every op that touches
// that data throw, not read a null pointer. LibTorch's StorageImpl can carry
// such a data-access error; which calls it offers depends on the version.
#include <c10/core/StorageImpl.h>

#include <string>

namespace shardtorch::storage_access {

enum class Support {
  None,                ///< no access error: a freed storage is read through a null pointer
  SetWithPrivateLift,  ///< LibTorch sets the error but cannot lift it (2.11); lifted here through its flag
  Full,                ///< LibTorch sets and lifts it
};
Support support();
const char* describe(Support s);

/// Makes every access to `impl`'s data throw c10::Error(message). Returns
/// false (and changes nothing) where this LibTorch cannot.
bool forbid(c10::StorageImpl* impl, std::string message);
/// Lifts forbid's error; nothing where none was set.
void allow(c10::StorageImpl* impl);

namespace testing {
/// Whether lift_through_flag is compiled in (LibTorch 2.11 to 2.13).
bool can_lift_through_flag();
/// The SetWithPrivateLift path's lift, run whatever support() says, so that
/// it is tested on a LibTorch that lifts the error itself too.
void lift_through_flag(c10::StorageImpl* impl);
}  // namespace testing

}  // namespace shardtorch::storage_access
