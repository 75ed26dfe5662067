#include "checkpoint/safetensors_format.h"

#include <algorithm>
#include <cstring>
#include <set>
#include <sstream>

namespace shardtorch::checkpoint {
namespace {

[[noreturn]] void fail(const std::string& file, const std::string& what) {
  throw SafetensorsError("safetensors file '" + file + "': " + what);
}

// A strict parser for the JSON subset safetensors headers use: objects,
// arrays, strings and non-negative integers.
struct Json {
  enum Kind { Object, Array, String, Integer } kind = Object;
  std::vector<std::string> keys;  // Object, in order (values in `items`)
  std::vector<Json> items;        // Array elements, or the Object's values
  std::string text;               // String
  uint64_t number = 0;            // Integer
};

class Parser {
 public:
  Parser(const char* p, size_t n, const std::string& file) : p_(p), end_(p + n), file_(file) {}

  Json document() {
    Json v = value(0);
    skip_space();
    if (p_ != end_) error("unexpected bytes after the JSON object");
    return v;
  }

 private:
  [[noreturn]] void error(const std::string& what) {
    fail(file_, "header JSON: " + what + " at byte " + std::to_string(offset()));
  }
  size_t offset() const { return static_cast<size_t>(p_ - begin_); }
  void skip_space() {
    while (p_ != end_ && (*p_ == ' ' || *p_ == '\t' || *p_ == '\n' || *p_ == '\r')) ++p_;
  }
  char peek() {
    skip_space();
    if (p_ == end_) error("unexpected end");
    return *p_;
  }
  void expect(char c) {
    if (peek() != c) error(std::string("expected '") + c + "'");
    ++p_;
  }

  Json value(int depth) {
    if (depth > 8) error("nesting too deep");
    char c = peek();
    if (c == '{') return object(depth);
    if (c == '[') return array(depth);
    if (c == '"') {
      Json s;
      s.kind = Json::String;
      s.text = string();
      return s;
    }
    if (c >= '0' && c <= '9') return integer();
    error(std::string("unsupported value starting with '") + c + "'");
  }

  Json object(int depth) {
    Json o;
    o.kind = Json::Object;
    expect('{');
    std::set<std::string> keys;
    if (peek() == '}') {
      ++p_;
      return o;
    }
    while (true) {
      if (peek() != '"') error("expected a string key");
      std::string key = string();
      if (!keys.insert(key).second) error("duplicate key '" + key + "'");
      expect(':');
      o.keys.push_back(std::move(key));
      o.items.push_back(value(depth + 1));
      char c = peek();
      ++p_;
      if (c == '}') return o;
      if (c != ',') error("expected ',' or '}'");
    }
  }

  Json array(int depth) {
    Json a;
    a.kind = Json::Array;
    expect('[');
    if (peek() == ']') {
      ++p_;
      return a;
    }
    while (true) {
      a.items.push_back(value(depth + 1));
      char c = peek();
      ++p_;
      if (c == ']') return a;
      if (c != ',') error("expected ',' or ']'");
    }
  }

  Json integer() {
    Json v;
    v.kind = Json::Integer;
    if (*p_ == '0' && p_ + 1 != end_ && p_[1] >= '0' && p_[1] <= '9') error("leading zero");
    while (p_ != end_ && *p_ >= '0' && *p_ <= '9') {
      uint64_t d = static_cast<uint64_t>(*p_ - '0');
      if (v.number > (UINT64_MAX - d) / 10) error("integer overflows 64 bits");
      v.number = v.number * 10 + d;
      ++p_;
    }
    if (p_ != end_ && (*p_ == '.' || *p_ == 'e' || *p_ == 'E')) error("only integers are allowed");
    return v;
  }

  // The four hex digits of a \u escape.
  unsigned hex4() {
    if (end_ - p_ < 4) error("short \\u escape");
    unsigned v = 0;
    for (int i = 0; i < 4; ++i) {
      char h = *p_++;
      v <<= 4;
      if (h >= '0' && h <= '9')
        v |= static_cast<unsigned>(h - '0');
      else if (h >= 'a' && h <= 'f')
        v |= static_cast<unsigned>(h - 'a' + 10);
      else if (h >= 'A' && h <= 'F')
        v |= static_cast<unsigned>(h - 'A' + 10);
      else
        error("bad \\u escape");
    }
    return v;
  }

  std::string string() {
    ++p_;  // opening quote
    std::string out;
    while (true) {
      if (p_ == end_) error("unterminated string");
      unsigned char c = static_cast<unsigned char>(*p_++);
      if (c == '"') return out;
      if (c < 0x20) error("control character in a string");
      if (c != '\\') {
        out += static_cast<char>(c);
        continue;
      }
      if (p_ == end_) error("unterminated escape");
      char e = *p_++;
      switch (e) {
        case '"':
          out += '"';
          break;
        case '\\':
          out += '\\';
          break;
        case '/':
          out += '/';
          break;
        case 'b':
          out += '\b';
          break;
        case 'f':
          out += '\f';
          break;
        case 'n':
          out += '\n';
          break;
        case 'r':
          out += '\r';
          break;
        case 't':
          out += '\t';
          break;
        case 'u': {
          unsigned cp = hex4();
          if (cp >= 0xDC00 && cp <= 0xDFFF) error("a low surrogate \\u escape without a high one before it");
          if (cp >= 0xD800 && cp <= 0xDBFF) {  // a pair (JSON's way to write U+10000 and above)
            if (end_ - p_ < 2 || p_[0] != '\\' || p_[1] != 'u') error("a high surrogate \\u escape without its pair");
            p_ += 2;
            const unsigned low = hex4();
            if (low < 0xDC00 || low > 0xDFFF) error("a high surrogate \\u escape without its pair");
            cp = 0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00);
            out += static_cast<char>(0xF0 | (cp >> 18));
            out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
            out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
            out += static_cast<char>(0x80 | (cp & 0x3F));
            break;
          }
          if (cp < 0x80) {
            out += static_cast<char>(cp);
          } else if (cp < 0x800) {
            out += static_cast<char>(0xC0 | (cp >> 6));
            out += static_cast<char>(0x80 | (cp & 0x3F));
          } else {
            out += static_cast<char>(0xE0 | (cp >> 12));
            out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
            out += static_cast<char>(0x80 | (cp & 0x3F));
          }
          break;
        }
        default:
          error(std::string("bad escape '\\") + e + "'");
      }
    }
  }

  const char* p_;
  const char* end_;
  const char* begin_ = p_;
  const std::string& file_;
};

// Whether `s` is well-formed UTF-8 (no overlong forms, no surrogates,
// nothing past U+10FFFF): Python's safetensors refuses a header that is not.
bool valid_utf8(const std::string& s) {
  size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<unsigned char>(s[i]);
    int extra;
    unsigned cp;
    if (c < 0x80) {
      ++i;
      continue;
    } else if (c >= 0xC2 && c <= 0xDF) {
      extra = 1, cp = c & 0x1F;
    } else if (c >= 0xE0 && c <= 0xEF) {
      extra = 2, cp = c & 0x0F;
    } else if (c >= 0xF0 && c <= 0xF4) {
      extra = 3, cp = c & 0x07;
    } else {
      return false;
    }
    if (i + extra >= s.size()) return false;
    for (int k = 1; k <= extra; ++k) {
      const auto d = static_cast<unsigned char>(s[i + k]);
      if ((d & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (d & 0x3F);
    }
    if ((extra == 2 && cp < 0x800) || (extra == 3 && (cp < 0x10000 || cp > 0x10FFFF)) || (cp >= 0xD800 && cp <= 0xDFFF))
      return false;
    i += static_cast<size_t>(extra) + 1;
  }
  return true;
}

// `s` with every byte outside printable ASCII as \xNN: an invalid string,
// shown in an error message.
std::string escaped(const std::string& s) {
  std::string out;
  for (unsigned char c : s) {
    if (c >= 0x20 && c < 0x7F) {
      out += static_cast<char>(c);
    } else {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\x%02X", c);
      out += buf;
    }
  }
  return out;
}

// Names and metadata are UTF-8, on reading as on writing: Python's
// safetensors refuses a header that is not.
// `what` describes the string (escaped() shows its bytes).
void require_utf8(const std::string& s, const std::string& file, const std::string& what) {
  if (!valid_utf8(s))
    fail(file, what +
                   " is not valid UTF-8 (Python's safetensors refuses such a file; write it again with "
                   "UTF-8 names and metadata)");
}

}  // namespace

std::string quote(const std::string& s) {
  if (!valid_utf8(s))
    throw SafetensorsError("safetensors: the name or metadata string '" + s +
                           "' is not valid UTF-8 (Python's safetensors would refuse the file)");
  std::string out = "\"";
  for (unsigned char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\u%04x", c);
      out += buf;
    } else {
      out += static_cast<char>(c);
    }
  }
  return out + "\"";
}

size_t dtype_size(const std::string& d) {
  if (d == "F64" || d == "I64" || d == "U64") return 8;
  if (d == "F32" || d == "I32" || d == "U32") return 4;
  if (d == "F16" || d == "BF16" || d == "I16" || d == "U16") return 2;
  if (d == "I8" || d == "U8" || d == "BOOL") return 1;
  return 0;
}

const TensorRecord* SafetensorsHeader::find(const std::string& name) const {
  auto it = positions.find(name);
  return it == positions.end() ? nullptr : &tensors[it->second];
}

namespace {

// The header's __metadata__: string keys to string values, UTF-8.
void read_metadata(const Json& v, const std::string& file, std::map<std::string, std::string>& out) {
  if (v.kind != Json::Object) fail(file, "__metadata__ is not an object");
  for (size_t j = 0; j < v.keys.size(); ++j) {
    require_utf8(v.keys[j], file, "__metadata__ key '" + escaped(v.keys[j]) + "'");
    if (v.items[j].kind != Json::String) fail(file, "__metadata__ value of '" + v.keys[j] + "' is not a string");
    require_utf8(v.items[j].text, file, "__metadata__ value '" + escaped(v.items[j].text) + "' of '" + v.keys[j] + "'");
    out[v.keys[j]] = v.items[j].text;
  }
}

// One tensor's entry: exactly dtype, shape and data_offsets, whose span is
// what the shape and the dtype need.
TensorRecord read_tensor(const std::string& name, const Json& v, const std::string& file) {
  require_utf8(name, file, "tensor name '" + escaped(name) + "'");
  if (v.kind != Json::Object) fail(file, "entry '" + name + "' is not an object");
  TensorRecord t;
  t.name = name;
  bool have_dtype = false, have_shape = false, have_offsets = false;
  for (size_t j = 0; j < v.keys.size(); ++j) {
    const std::string& k = v.keys[j];
    const Json& f = v.items[j];
    if (k == "dtype") {
      if (f.kind != Json::String) fail(file, "tensor '" + name + "': dtype is not a string");
      t.dtype = f.text;
      have_dtype = true;
    } else if (k == "shape") {
      if (f.kind != Json::Array) fail(file, "tensor '" + name + "': shape is not an array");
      for (auto& d : f.items) {
        if (d.kind != Json::Integer || d.number > static_cast<uint64_t>(INT64_MAX))
          fail(file, "tensor '" + name + "': shape holds something other than a non-negative integer");
        t.shape.push_back(static_cast<int64_t>(d.number));
      }
      have_shape = true;
    } else if (k == "data_offsets") {
      if (f.kind != Json::Array || f.items.size() != 2 || f.items[0].kind != Json::Integer ||
          f.items[1].kind != Json::Integer)
        fail(file, "tensor '" + name + "': data_offsets is not two integers");
      t.begin = f.items[0].number;
      t.end = f.items[1].number;
      have_offsets = true;
    } else {
      fail(file, "tensor '" + name + "': unknown field '" + k + "'");
    }
  }
  if (!have_dtype || !have_shape || !have_offsets)
    fail(file, "tensor '" + name + "': missing dtype, shape or data_offsets");
  size_t es = dtype_size(t.dtype);
  if (es == 0) fail(file, "tensor '" + name + "': unknown dtype '" + t.dtype + "'");
  if (t.begin > t.end)
    fail(file, "tensor '" + name + "': data_offsets [" + std::to_string(t.begin) + ", " + std::to_string(t.end) +
                   "] run backwards");
  uint64_t bytes = es;
  for (int64_t d : t.shape) {
    uint64_t ud = static_cast<uint64_t>(d);
    if (ud != 0 && bytes > UINT64_MAX / ud) fail(file, "tensor '" + name + "': shape times element size overflows");
    bytes *= ud;
  }
  if (bytes != t.end - t.begin)
    fail(file, "tensor '" + name + "': shape and dtype need " + std::to_string(bytes) +
                   " bytes but data_offsets span " + std::to_string(t.end - t.begin));
  return t;
}

// The tensors, sorted by offset, tile the data section exactly: no gap, no
// overlap, nothing after them.
void require_tiled(std::vector<TensorRecord>& tensors, uint64_t data_bytes, const std::string& file) {
  std::sort(tensors.begin(), tensors.end(), [](const TensorRecord& a, const TensorRecord& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  uint64_t at = 0;
  for (const auto& t : tensors) {
    if (t.begin != at)
      fail(file, "tensor '" + t.name + "' starts at " + std::to_string(t.begin) + " but the previous data ends at " +
                     std::to_string(at) + (t.begin < at ? " (overlap)" : " (gap)"));
    at = t.end;
  }
  if (at != data_bytes)
    fail(file, "data section is " + std::to_string(data_bytes) + " bytes but the tensors cover " + std::to_string(at) +
                   (at < data_bytes ? " (trailing bytes)" : " (truncated file)"));
}

}  // namespace

SafetensorsHeader parse_header(const uint8_t* prefix, size_t prefix_size, uint64_t file_size, const std::string& file) {
  if (file_size < 8 || prefix_size < 8)
    fail(file, "shorter than the 8-byte header length (" + std::to_string(file_size) + " bytes)");
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | prefix[i];
  if (n > kMaxHeaderBytes) fail(file, "header length " + std::to_string(n) + " exceeds the 100 MB limit");
  if (n > file_size - 8)
    fail(file,
         "header length " + std::to_string(n) + " is larger than the file (" + std::to_string(file_size) + " bytes)");
  if (prefix_size < 8 + n) fail(file, "header not fully read");

  Json doc = Parser(reinterpret_cast<const char*>(prefix + 8), static_cast<size_t>(n), file).document();
  if (doc.kind != Json::Object) fail(file, "header is not a JSON object");
  SafetensorsHeader h;
  h.data_start = 8 + n;
  for (size_t m = 0; m < doc.keys.size(); ++m) {
    if (doc.keys[m] == "__metadata__")
      read_metadata(doc.items[m], file, h.metadata);
    else
      h.tensors.push_back(read_tensor(doc.keys[m], doc.items[m], file));
  }
  require_tiled(h.tensors, file_size - h.data_start, file);
  for (size_t i = 0; i < h.tensors.size(); ++i) h.positions.emplace(h.tensors[i].name, i);
  return h;
}

std::string serialize_header(const std::vector<TensorRecord>& tensors,
                             const std::map<std::string, std::string>& metadata) {
  std::ostringstream js;
  js << "{";
  bool first = true;
  if (!metadata.empty()) {
    js << "\"__metadata__\":{";
    bool f = true;
    for (const auto& [k, v] : metadata) {
      js << (f ? "" : ",") << quote(k) << ":" << quote(v);
      f = false;
    }
    js << "}";
    first = false;
  }
  for (const auto& t : tensors) {
    js << (first ? "" : ",") << quote(t.name) << ":{\"dtype\":" << quote(t.dtype) << ",\"shape\":[";
    for (size_t i = 0; i < t.shape.size(); ++i) js << (i ? "," : "") << t.shape[i];
    js << "],\"data_offsets\":[" << t.begin << "," << t.end << "]}";
    first = false;
  }
  js << "}";
  std::string json = js.str();
  while ((8 + json.size()) % 8 != 0) json += ' ';
  std::string out(8, '\0');
  uint64_t n = json.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xFF);
  return out + json;
}

}  // namespace shardtorch::checkpoint
