#pragma once
// Internal: Python pickles (protocols 2 to 5) read without executing
// anything, for PyTorch distributed checkpoints (the .metadata file, each
// item's data.pkl and the pickled values of its BYTE_IO items). Plain C++
// (no ATen), so that the fuzz target builds it alone.
//
// The reader builds a tree of plain nodes. Globals are names, never looked
// up; REDUCE and NEWOBJ record the call they describe (a node holding the
// callable's name and the arguments) and BUILD records the state, for the
// caller to interpret against the classes it expects. Only the opcodes and
// the globals of the caller's allow-list are accepted; every length and
// memo reference is bounds-checked; anything else throws SafetensorsError
// naming the file and the byte.
#include <cstdint>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "shardtorch/checkpoint/safetensors_error.h"

namespace shardtorch::checkpoint::pickle {

enum class Kind : uint8_t {
  None,
  Bool,
  Int,
  Float,
  String,
  Tuple,
  List,
  Dict,    // items: key, value, key, value, ...
  Global,  // text: module, name: name
  Reduce,  // items: callable (a Global), args (a Tuple)
  Object,  // NEWOBJ: items: class (a Global), args (a Tuple)[, state (after BUILD)]
  PersId,  // BINPERSID: items: the persistent id
};

const char* kind_name(Kind k);

struct Node {
  Kind kind = Kind::None;
  bool b = false;
  int64_t i = 0;
  double f = 0;
  std::string text;  // String: the text; Global: the module
  std::string name;  // Global: the name
  std::vector<uint32_t> items;
  bool built = false;  // Object: BUILD gave it a state (items[2])
  uint64_t at = 0;     // the byte (in the file) of the opcode that made it
};

/// What a caller accepts.
struct Policy {
  std::set<uint8_t> opcodes;
  std::set<std::pair<std::string, std::string>> globals;  // (module, name)
};

/// The opcodes of protocols 2 to 5 that describe plain data (no globals, no
/// calls, no persistent ids): PROTO FRAME STOP MARK, the tuple, list and dict
/// opcodes, strings, ints, floats, None and bools, and the memo.
std::set<uint8_t> data_opcodes();

class Tree {
 public:
  const Node& at(uint32_t i) const { return nodes_.at(i); }
  uint32_t root() const { return root_; }
  size_t size() const { return nodes_.size(); }

 private:
  friend Tree parse(const uint8_t*, size_t, const Policy&, const std::string&, uint64_t);
  std::vector<Node> nodes_;
  uint32_t root_ = 0;
};

/// Parses the pickle in [data, data + size). `where` names the file (or the
/// item of a file) in errors ("DCP metadata 'DIR/.metadata'"); `base` is the
/// position of data[0] in that file, so that errors name the file's byte.
/// The pickle must end with STOP at the last byte, leaving one object.
Tree parse(const uint8_t* data, size_t size, const Policy& policy, const std::string& where, uint64_t base = 0);

/// Writes pickles of protocol 2 without a memo: what Python's pickle.load
/// and torch.load read (the DCP metadata, torch.save's data.pkl, plain
/// values). The caller writes a well-formed sequence.
class Writer {
 public:
  Writer() { out_ = "\x80\x02"; }
  Writer& global(const std::string& module, const std::string& name);
  Writer& mark() { return op('('); }
  Writer& tuple() { return op('t'); }  // MARK ... TUPLE
  Writer& empty_tuple() { return op(')'); }
  Writer& empty_list() { return op(']'); }
  Writer& appends() { return op('e'); }  // list MARK ... APPENDS
  Writer& empty_dict() { return op('}'); }
  Writer& setitems() { return op('u'); }  // dict MARK k v ... SETITEMS
  Writer& reduce() { return op('R'); }
  Writer& newobj() { return op('\x81'); }
  Writer& build() { return op('b'); }
  Writer& persid() { return op('Q'); }
  Writer& none() { return op('N'); }
  Writer& boolean(bool v) { return op(v ? '\x88' : '\x89'); }
  Writer& integer(int64_t v);
  Writer& real(double v);
  Writer& string(const std::string& s);
  /// STOP, and the bytes.
  std::string finish();

 private:
  Writer& op(char c) {
    out_.push_back(c);
    return *this;
  }
  std::string out_;
};

}  // namespace shardtorch::checkpoint::pickle
