// safetensors files: every dtype round-trips, the reader refuses every
// malformed file with a message naming it, names are UTF-8, writes are atomic.
#include <gtest/gtest.h>

#include <fstream>

#include "../src/checkpoint/reader_access.h"
#include "checkpoint_helpers.h"
#include "models.h"
#include "shardtorch/checkpoint.h"

using namespace testmodels;
using shardtorch::checkpoint::SafetensorsError;

namespace {

std::string error_of(const Path& p) {
  try {
    shardtorch::checkpoint::Reader r(p.string());
  } catch (const SafetensorsError& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(Safetensors, RoundTripsDtypesShapesAndMetadata) {
  const TempDir dir;
  auto path = (dir / "t.safetensors").string();
  std::vector<std::pair<std::string, at::Tensor>> ts = {
      {"f32", at::randn({3, 4})},        {"bf16", at::randn({5}).to(at::kBFloat16)},
      {"i64", at::arange(7, at::kLong)}, {"scalar", at::full({}, 2.5)},
      {"empty", at::empty({0, 3})},      {"name with \"quotes\" and \\", at::ones({2}, at::kDouble)},
  };
  shardtorch::checkpoint::save_file(path, ts, {{"step", "42"}});
  shardtorch::checkpoint::Reader r(path);
  EXPECT_EQ(shardtorch::checkpoint::ReaderAccess::header(r).metadata.at("step"), "42");
  for (auto& [n, t] : ts) {
    auto got = r.read(n);
    EXPECT_EQ(got.scalar_type(), t.scalar_type()) << n;
    EXPECT_TRUE(at::equal(got, t)) << n;
  }
  EXPECT_TRUE(at::equal(r.read_range("i64", 2, 3), at::arange(2, 5, at::kLong)));
  // Every tensor starts at a multiple of its element size in the file (the
  // bf16 tensor's 10 bytes, written in the given order, put the int64 one at
  // 58), for readers that map the file and cast in place.
  EXPECT_EQ(shardtorch::checkpoint::ReaderAccess::header(r).data_start % 8, 0u);
  for (const auto& rec : shardtorch::checkpoint::ReaderAccess::header(r).tensors)
    EXPECT_EQ((shardtorch::checkpoint::ReaderAccess::header(r).data_start + rec.begin) %
                  shardtorch::checkpoint::dtype_size(rec.dtype),
              0u)
        << rec.name;
  EXPECT_THROW(r.read_range("i64", 5, 3), SafetensorsError);
  EXPECT_THROW(r.read("missing"), SafetensorsError);
}

// A program's own reader: the names, the metadata and each tensor's dtype,
// shape and size through the installed header alone, without reading data.
TEST(Safetensors, ThePublicReaderListsNamesAndMetadata) {
  const TempDir dir;
  auto path = (dir / "t.safetensors").string();
  shardtorch::checkpoint::save_file(path, {{"b", at::ones({2})}, {"a", at::zeros({3}, at::kDouble)}},
                                    {{"step", "42"}, {"note", "x"}});
  shardtorch::checkpoint::Reader r(path);
  EXPECT_EQ(r.metadata(), (std::map<std::string, std::string>{{"note", "x"}, {"step", "42"}}));
  auto names = r.names();  // data order: the writer puts wider elements first
  EXPECT_EQ(names, (std::vector<std::string>{"a", "b"}));
  auto infos = r.tensors();
  ASSERT_EQ(infos.size(), 2u);
  EXPECT_EQ(infos[0].name, "a");
  EXPECT_EQ(infos[0].dtype, at::kDouble);
  EXPECT_EQ(infos[0].shape, (std::vector<int64_t>{3}));
  EXPECT_EQ(infos[0].nbytes, 24);
  auto b = r.info("b");
  EXPECT_EQ(b.dtype, at::kFloat);
  EXPECT_EQ(b.shape, (std::vector<int64_t>{2}));
  EXPECT_EQ(b.nbytes, 8);
  EXPECT_THROW(r.info("missing"), shardtorch::checkpoint::SafetensorsError);
  auto bare = (dir / "bare.safetensors").string();
  shardtorch::checkpoint::save_file(bare, {{"x", at::ones({1})}});
  EXPECT_TRUE(shardtorch::checkpoint::Reader(bare).metadata().empty());
}

// Every dtype the header check lets through must become an ATen tensor and
// back: a valid file must never pass the checks and then fail while a model
// is half loaded (U16/U32/U64 once did).
TEST(Safetensors, EveryDtypeTheHeaderAcceptsReadsAndWritesAsATen) {
  using shardtorch::checkpoint::dtype_name;
  using shardtorch::checkpoint::dtype_size;
  using shardtorch::checkpoint::scalar_type;
  for (std::string d : {"F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U64", "U32", "U16", "U8", "BOOL"}) {
    ASSERT_GT(dtype_size(d), 0u) << d;
    at::ScalarType t = scalar_type(d);
    EXPECT_EQ(dtype_name(t), d);
    EXPECT_EQ(c10::elementSize(t), dtype_size(d)) << d;
  }
  EXPECT_EQ(dtype_size("F8_E4M3"), 0u);  // refused by the header check, so never asked of scalar_type
  const TempDir dir;
  auto path = (dir / "u.safetensors").string();
  std::vector<std::pair<std::string, at::Tensor>> ts;
  for (auto t : {at::kUInt16, at::kUInt32, at::kUInt64})
    ts.push_back({c10::toString(t), at::arange(5, at::kLong).mul(1000).to(t)});
  shardtorch::checkpoint::save_file(path, ts, {});
  shardtorch::checkpoint::Reader r(path);
  for (auto& [n, t] : ts) {
    auto got = r.read(n);
    EXPECT_EQ(got.scalar_type(), t.scalar_type()) << n;
    EXPECT_TRUE(at::equal(got.to(at::kLong), t.to(at::kLong))) << n;
    EXPECT_TRUE(at::equal(r.read_range(n, 1, 3).to(at::kLong), at::arange(1, 4, at::kLong).mul(1000))) << n;
  }
}

TEST(Safetensors, RefusesMalformedFilesNamingFileAndProblem) {
  const TempDir dir;
  auto p = dir / "bad.safetensors";
  const std::string ok = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  struct Case {
    std::string json, data, expect;
  };
  std::vector<Case> cases = {
      {ok, std::string(4, 'x'), "truncated file"},
      {ok, std::string(12, 'x'), "trailing bytes"},
      {R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
       std::string(12, 'x'), "overlap"},
      {R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})",
       std::string(12, 'x'), "gap"},
      {R"({"a":{"dtype":"F32","shape":[4611686018427387904,8],"data_offsets":[0,8]}})", std::string(8, 'x'),
       "overflows"},
      {R"({"a":{"dtype":"Q7","shape":[2],"data_offsets":[0,8]}})", std::string(8, 'x'), "unknown dtype 'Q7'"},
      {R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"a":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})",
       std::string(16, 'x'), "duplicate key 'a'"},
      {R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", std::string(8, 'x'), "need 12 bytes"},
      {R"({"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", std::string(8, 'x'), "unsupported value"},
      {R"({"a":{"dtype":"F32","shape":[2.0],"data_offsets":[0,8]}})", std::string(8, 'x'), "only integers"},
      {R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})", std::string(8, 'x'), "run backwards"},
      {R"({"a":{"dtype":"F32","shape":[2]}})", std::string(8, 'x'), "missing dtype, shape or data_offsets"},
      {R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})", std::string(8, 'x'), "unexpected end"},
      {R"({"__metadata__":{"k":1}})", "", "is not a string"},
      {R"({"__metadata__":{"k":"\udc00"}})", "", "a low surrogate"},
      {R"({"__metadata__":{"k":"\ud83dx"}})", "", "without its pair"},
  };
  for (const auto& c : cases) {
    write_raw(p, c.json, c.data);
    std::string e = error_of(p);
    EXPECT_NE(e.find(p.string()), std::string::npos) << c.expect << ": " << e;
    EXPECT_NE(e.find(c.expect), std::string::npos) << "expected '" << c.expect << "', got: " << e;
  }
  // A header larger than the file, and larger than the 100 MB limit.
  for (uint64_t n : {uint64_t{1000}, uint64_t{200} * 1000 * 1000}) {
    std::string bytes(8, '\0');
    for (int i = 0; i < 8; ++i) bytes[i] = static_cast<char>((n >> (8 * i)) & 0xFF);
    std::ofstream(p, std::ios::binary) << bytes << "{}";
    std::string e = error_of(p);
    EXPECT_NE(e.find(n == 1000 ? "larger than the file" : "exceeds the 100 MB limit"), std::string::npos) << e;
  }
  std::ofstream(p, std::ios::binary) << "abc";
  EXPECT_NE(error_of(p).find("shorter than the 8-byte header length"), std::string::npos);
  EXPECT_NE(error_of(dir / "nope").find("cannot open"), std::string::npos);
}

// Names and metadata are UTF-8 both ways, as Python's safetensors has them:
// characters past U+FFFF escaped as a surrogate pair (as JSON writers do)
// read back as themselves; a string that is not UTF-8 is refused on writing
// (Python would refuse the whole file), and nothing is written.
TEST(Safetensors, NamesAndMetadataAreUtf8BothWays) {
  const TempDir dir;
  auto p = dir / "u.safetensors";
  write_raw(p, R"({"__metadata__":{"k":"\ud83d\ude00 \u00e9"},"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})",
            std::string(4, '\0'));
  shardtorch::checkpoint::Reader r(p.string());
  EXPECT_EQ(shardtorch::checkpoint::ReaderAccess::header(r).metadata.at("k"),
            "\xF0\x9F\x98\x80 \xC3\xA9");  // U+1F600, U+00E9
  const auto q = (dir / "v.safetensors").string();
  const std::string named = "w\xC3\xA9ight \xF0\x9F\x98\x80";
  shardtorch::checkpoint::save_file(q, {{named, at::ones({2})}}, {{"note", "\xE2\x82\xAC"}});
  auto back = shardtorch::checkpoint::load_file(q);
  EXPECT_TRUE(back.count(named)) << "a UTF-8 name did not round-trip";
  for (const std::string bad :
       {std::string("\xFF"), std::string("\xC0\x80"), std::string("\xED\xA0\x80"), std::string("\xE2\x82")}) {
    const auto b = (dir / "bad.safetensors").string();
    std::string e = message_of([&] { shardtorch::checkpoint::save_file(b, {{"t", at::ones({1})}}, {{"k", bad}}); });
    EXPECT_NE(e.find("is not valid UTF-8"), std::string::npos) << e;
    e = message_of([&] { shardtorch::checkpoint::save_file(b, {{bad, at::ones({1})}}); });
    EXPECT_NE(e.find("is not valid UTF-8"), std::string::npos) << e;
    EXPECT_FALSE(files::exists(b)) << "a refused write left a file";
  }
}

TEST(Safetensors, AFailedWriteLeavesThePreviousFileIntact) {
  const TempDir dir;
  auto path = (dir / "m.safetensors").string();
  shardtorch::checkpoint::save_file(path, {{"w", at::ones({4})}});
  std::vector<shardtorch::checkpoint::PendingTensor> pending = {
      {"w", at::kFloat, {4}, [] { return at::zeros({4}); }},
      {"v", at::kFloat, {4}, []() -> at::Tensor { throw std::runtime_error("killed while writing"); }},
  };
  EXPECT_THROW(shardtorch::checkpoint::write_file(path, pending), std::runtime_error);
  auto back = shardtorch::checkpoint::load_file(path);
  ASSERT_EQ(back.size(), 1u);
  EXPECT_TRUE(at::equal(back.at("w"), at::ones({4})));
  size_t regular = 0;
  for (const auto& name : files::list_directory(dir)) regular += files::is_regular_file(dir / name);
  EXPECT_EQ(regular, 1u) << "a temporary file was left behind";
}
