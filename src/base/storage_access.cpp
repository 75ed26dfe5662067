#include "base/storage_access.h"
#include "base/check.h"

#include <torch/version.h>

#include <type_traits>
#include <utility>

namespace shardtorch::storage_access {

namespace {
// Detected rather than assumed, so that any LibTorch 2.x compiles.
template <typename S, typename = void>
struct CanSet : std::false_type {};
template <typename S>
struct CanSet<S, std::void_t<decltype(std::declval<S&>().release_data_and_set_meta_custom_data_ptr_error_msg_(
                     std::declval<std::string>()))>> : std::true_type {};
template <typename S, typename = void>
struct CanLift : std::false_type {};
template <typename S>
struct CanLift<S, std::void_t<decltype(std::declval<S&>().clear_data_ptr_access_error_msg_())>> : std::true_type {};

#if TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 11 && TORCH_VERSION_MINOR <= 13
#define SHARDTORCH_LIFT_THROUGH_FLAG 1
// LibTorch 2.11 sets the error (release_data_and_set_meta_custom_data_ptr_error_msg_
// raises the private flag throw_on_immutable_data_ptr_ and stores the message)
// but has no call that lowers the flag again; later versions added
// clear_data_ptr_access_error_msg_, which does what lift_through_flag does.
// Access checking does not apply to the names in an explicit instantiation
// (C++20 [temp.spec.general]/6), so the one below may name the private flag;
// the friend it defines hands out a pointer to it. Admitted for the versions
// whose header was read only, 2.11 to 2.13 (the flag is not public API: a
// later LibTorch that renamed it must still compile, and lifts by itself).
bool c10::StorageImpl::*immutable_data_flag();
template <bool c10::StorageImpl::*Flag>
struct FlagKey {
  friend bool c10::StorageImpl::*immutable_data_flag() { return Flag; }
};
template struct FlagKey<&c10::StorageImpl::throw_on_immutable_data_ptr_>;
#endif

template <typename S>
constexpr Support support_of() {
  if constexpr (!CanSet<S>::value) {
    return Support::None;
  } else if constexpr (CanLift<S>::value) {
    return Support::Full;
  } else {
#ifdef SHARDTORCH_LIFT_THROUGH_FLAG
    return Support::SetWithPrivateLift;
#else
    return Support::None;
#endif
  }
}
constexpr Support kSupport = support_of<c10::StorageImpl>();

template <typename S>
void set_error(S* impl, std::string message) {
  if constexpr (CanSet<S>::value) impl->release_data_and_set_meta_custom_data_ptr_error_msg_(std::move(message));
}

template <typename S>
void lift_error(S* impl) {
  if constexpr (CanLift<S>::value) {
    impl->clear_data_ptr_access_error_msg_();
  } else if constexpr (support_of<S>() == Support::SetWithPrivateLift) {
    testing::lift_through_flag(impl);
  }
}
}  // namespace

Support support() { return kSupport; }

const char* describe(Support s) {
  switch (s) {
    case Support::None:
      return "none (a freed parameter's data is a null pointer)";
    case Support::SetWithPrivateLift:
      return "set by LibTorch, lifted through its flag";
    case Support::Full:
      return "set and lifted by LibTorch";
  }
  return "?";
}

bool forbid(c10::StorageImpl* impl, std::string message) {
  if constexpr (kSupport == Support::None) {
    return false;
  } else {
    set_error(impl, std::move(message));
    return true;
  }
}

void allow(c10::StorageImpl* impl) { lift_error(impl); }

bool testing::can_lift_through_flag() {
#ifdef SHARDTORCH_LIFT_THROUGH_FLAG
  return true;
#else
  return false;
#endif
}

void testing::lift_through_flag(c10::StorageImpl* impl) {
#ifdef SHARDTORCH_LIFT_THROUGH_FLAG
  impl->*immutable_data_flag() = false;
  // (LibTorch's own lift leaves a storage without extra metadata as it is;
  // get_extra_meta() gives it an empty one, which changes nothing else.)
  impl->get_extra_meta().custom_data_ptr_error_msg_ = std::nullopt;
  // set_data_ptr_noswap recomputes the storage's one "any check?" bit from its flags.
  at::DataPtr data = std::move(impl->_mutable_data_ptr_no_checks());
  impl->set_data_ptr_noswap(std::move(data));
#else
  SHARDTORCH_CHECK(false, "shardtorch: lift_through_flag is compiled for LibTorch 2.11 to 2.13 only (this is ",
                   TORCH_VERSION, ")");
#endif
}

}  // namespace shardtorch::storage_access
