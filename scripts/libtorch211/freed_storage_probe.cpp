// Run by check.sh against LibTorch 2.11's own headers and libraries: the library's freed-storage path.
#include <ATen/ATen.h>
#include <cstdio>
#include "../../src/base/storage_access.cpp"  // the library's code, compiled against 2.11
namespace sa = shardtorch::storage_access;
int main() {
  std::printf("torch %s, support: %s\n", TORCH_VERSION, sa::describe(sa::support()));
  auto t = at::arange(6, at::kFloat);
  auto view = t.narrow(0, 2, 3);
  auto* impl = t.storage().unsafeGetStorageImpl();
  if (!sa::forbid(impl, "unit 'l1' is sharded")) { std::printf("FAIL: cannot forbid\n"); return 1; }
  int fails = 0;
  for (int i = 0; i < 2; ++i) {
    try { (void)(i ? t.add_(1) : view.sum()); std::printf("FAIL: no error\n"); ++fails; }
    catch (const c10::Error& e) { bool ok = std::string(e.what()).find("unit 'l1' is sharded") != std::string::npos;
      std::printf("%s: error %s\n", ok ? "ok" : "FAIL", ok ? "names the unit" : e.what()); fails += !ok; }
  }
  sa::allow(impl);
  float s = view.sum().item<float>();
  t.add_(1);
  float s2 = t.sum().item<float>();
  std::printf("%s: after allow, view sum %g (want 9), sum after add_ %g (want 21)\n", (s == 9 && s2 == 21) ? "ok" : "FAIL", s, s2);
  fails += !(s == 9 && s2 == 21);
  return fails;
}
