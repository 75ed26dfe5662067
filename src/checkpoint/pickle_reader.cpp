#include "checkpoint/pickle_reader.h"

#include <cstring>
#include <unordered_map>

namespace shardtorch::checkpoint::pickle {
namespace {

// The opcodes this reader knows (pickletools' names).
enum Op : uint8_t {
  MARK = '(',
  STOP = '.',
  BININT = 'J',
  BININT1 = 'K',
  BININT2 = 'M',
  NONE = 'N',
  BINPERSID = 'Q',
  REDUCE = 'R',
  BINUNICODE = 'X',
  EMPTY_LIST = ']',
  APPEND = 'a',
  BUILD = 'b',
  GLOBAL = 'c',
  APPENDS = 'e',
  BINGET = 'h',
  LONG_BINGET = 'j',
  BINPUT = 'q',
  LONG_BINPUT = 'r',
  SETITEM = 's',
  TUPLE = 't',
  SETITEMS = 'u',
  EMPTY_DICT = '}',
  EMPTY_TUPLE = ')',
  BINFLOAT = 'G',
  PROTO = 0x80,
  NEWOBJ = 0x81,
  TUPLE1 = 0x85,
  TUPLE2 = 0x86,
  TUPLE3 = 0x87,
  NEWTRUE = 0x88,
  NEWFALSE = 0x89,
  LONG1 = 0x8a,
  SHORT_BINUNICODE = 0x8c,
  BINUNICODE8 = 0x8d,
  STACK_GLOBAL = 0x93,
  MEMOIZE = 0x94,
  FRAME = 0x95,
};

// A table of every opcode's name, one case each (long by nature).
const char* op_name(uint8_t op) {
  switch (op) {
    case MARK:
      return "MARK";
    case STOP:
      return "STOP";
    case BININT:
      return "BININT";
    case BININT1:
      return "BININT1";
    case BININT2:
      return "BININT2";
    case NONE:
      return "NONE";
    case BINPERSID:
      return "BINPERSID";
    case REDUCE:
      return "REDUCE";
    case BINUNICODE:
      return "BINUNICODE";
    case EMPTY_LIST:
      return "EMPTY_LIST";
    case APPEND:
      return "APPEND";
    case BUILD:
      return "BUILD";
    case GLOBAL:
      return "GLOBAL";
    case APPENDS:
      return "APPENDS";
    case BINGET:
      return "BINGET";
    case LONG_BINGET:
      return "LONG_BINGET";
    case BINPUT:
      return "BINPUT";
    case LONG_BINPUT:
      return "LONG_BINPUT";
    case SETITEM:
      return "SETITEM";
    case TUPLE:
      return "TUPLE";
    case SETITEMS:
      return "SETITEMS";
    case EMPTY_DICT:
      return "EMPTY_DICT";
    case EMPTY_TUPLE:
      return "EMPTY_TUPLE";
    case BINFLOAT:
      return "BINFLOAT";
    case PROTO:
      return "PROTO";
    case NEWOBJ:
      return "NEWOBJ";
    case TUPLE1:
      return "TUPLE1";
    case TUPLE2:
      return "TUPLE2";
    case TUPLE3:
      return "TUPLE3";
    case NEWTRUE:
      return "NEWTRUE";
    case NEWFALSE:
      return "NEWFALSE";
    case LONG1:
      return "LONG1";
    case SHORT_BINUNICODE:
      return "SHORT_BINUNICODE";
    case BINUNICODE8:
      return "BINUNICODE8";
    case STACK_GLOBAL:
      return "STACK_GLOBAL";
    case MEMOIZE:
      return "MEMOIZE";
    case FRAME:
      return "FRAME";
    // Known to pickle, never accepted here: named in the error all the same.
    case 'i':
      return "INST";
    case 'o':
      return "OBJ";
    case 0x92:
      return "NEWOBJ_EX";
    case 'P':
      return "PERSID";
    case 0x82:
      return "EXT1";
    case 0x83:
      return "EXT2";
    case 0x84:
      return "EXT4";
    case 0x96:
      return "BYTEARRAY8";
    case 0x97:
      return "NEXT_BUFFER";
    case 0x98:
      return "READONLY_BUFFER";
    case 'C':
      return "SHORT_BINBYTES";
    case 'B':
      return "BINBYTES";
    case 0x8e:
      return "BINBYTES8";
    case '0':
      return "POP";
    case '1':
      return "POP_MARK";
    case '2':
      return "DUP";
    case 'd':
      return "DICT";
    case 'l':
      return "LIST";
    case 'I':
      return "INT";
    case 'L':
      return "LONG";
    case 'F':
      return "FLOAT";
    case 'S':
      return "STRING";
    case 'V':
      return "UNICODE";
    case 'g':
      return "GET";
    case 'p':
      return "PUT";
    case 0x8b:
      return "LONG4";
    case 0x8f:
      return "EMPTY_SET";
    case 0x90:
      return "ADDITEMS";
    case 0x91:
      return "FROZENSET";
    default:
      return nullptr;
  }
}

std::string hex(uint8_t b) {
  static const char* digits = "0123456789abcdef";
  return std::string("0x") + digits[b >> 4] + digits[b & 15];
}

class Parser {
 public:
  Parser(const uint8_t* data, size_t size, const Policy& policy, const std::string& where, uint64_t base,
         std::vector<Node>& nodes)
      : p_(data), n_(size), policy_(policy), where_(where), base_(base), nodes_(nodes) {}

  uint32_t run() {
    if (n_ == 0) fail(0, "empty (no pickle)");
    while (true) {
      if (pos_ >= n_) fail(pos_, "ends without STOP (truncated?)");
      op_at_ = pos_;
      const uint8_t op = p_[pos_++];
      if (!policy_.opcodes.count(op)) {
        const char* name = op_name(op);
        fail(op_at_, std::string("opcode ") + (name ? name : "") + (name ? " (" : "") + hex(op) + (name ? ")" : "") +
                         " is not allowed here (not one DCP writes)");
      }
      if (op_at_ == 0 && op != PROTO) fail(0, "does not start with PROTO (not a pickle of protocol 2 or later)");
      if (step(op)) break;
    }
    if (pos_ != n_) fail(pos_, std::to_string(n_ - pos_) + " bytes after STOP (the file is longer than its pickle)");
    if (stack_.size() != 1 || !marks_.empty())
      fail(op_at_, "STOP with " + std::to_string(stack_.size()) + " objects on the stack and " +
                       std::to_string(marks_.size()) + " marks (a malformed pickle)");
    return stack_.back();
  }

 private:
  [[noreturn]] void fail(uint64_t at, const std::string& what) const {
    throw SafetensorsError(where_ + ": byte " + std::to_string(base_ + at) + ": " + what);
  }
  const uint8_t* take(size_t k, const char* what) {
    if (k > n_ - pos_)
      fail(op_at_, std::string(what) + " runs past the end (" + std::to_string(k) + " bytes wanted, " +
                       std::to_string(n_ - pos_) + " left): truncated or corrupt");
    const uint8_t* q = p_ + pos_;
    pos_ += k;
    return q;
  }
  uint64_t le(size_t k, const char* what) {
    const uint8_t* q = take(k, what);
    uint64_t v = 0;
    for (size_t j = 0; j < k; ++j) v |= uint64_t{q[j]} << (8 * j);
    return v;
  }
  uint32_t add(Node n) {
    n.at = base_ + op_at_;
    nodes_.push_back(std::move(n));
    return static_cast<uint32_t>(nodes_.size() - 1);
  }
  uint32_t add_kind(Kind k) {
    Node n;
    n.kind = k;
    return add(std::move(n));
  }
  void push(uint32_t id) { stack_.push_back(id); }
  uint32_t pop() {
    if (stack_.size() <= floor()) fail(op_at_, "pops an empty stack (a malformed pickle)");
    uint32_t v = stack_.back();
    stack_.pop_back();
    return v;
  }
  uint32_t top() {
    if (stack_.size() <= floor()) fail(op_at_, "needs an object on an empty stack (a malformed pickle)");
    return stack_.back();
  }
  size_t floor() const { return marks_.empty() ? 0 : marks_.back(); }
  // The objects since the last MARK, which is removed.
  std::vector<uint32_t> pop_mark() {
    if (marks_.empty()) fail(op_at_, "no MARK to take objects from (a malformed pickle)");
    const size_t m = marks_.back();
    marks_.pop_back();
    std::vector<uint32_t> items(stack_.begin() + static_cast<std::ptrdiff_t>(m), stack_.end());
    stack_.resize(m);
    return items;
  }
  Node& node(uint32_t id) { return nodes_[id]; }
  void expect(uint32_t id, Kind k, const char* what) {
    if (node(id).kind != k)
      fail(op_at_, std::string(what) + " must be a " + kind_name(k) + ", not a " + kind_name(node(id).kind));
  }
  void push_string(uint64_t len) {
    if (len > n_ - pos_)
      fail(op_at_, "a string of " + std::to_string(len) + " bytes runs past the end (" + std::to_string(n_ - pos_) +
                       " bytes left): truncated or corrupt");
    Node n;
    n.kind = Kind::String;
    const uint8_t* q = take(static_cast<size_t>(len), "a string");
    n.text.assign(reinterpret_cast<const char*>(q), static_cast<size_t>(len));
    push(add(std::move(n)));
  }
  void push_int(int64_t v) {
    Node n;
    n.kind = Kind::Int;
    n.i = v;
    push(add(std::move(n)));
  }
  void push_global(std::string module, std::string name) {
    if (!policy_.globals.count({module, name}))
      fail(op_at_, "global '" + module + "." + name + "' is not on the allow-list (a DCP checkpoint names only " +
                       "its metadata classes, torch.Size, dtypes and tensor rebuild functions)");
    Node n;
    n.kind = Kind::Global;
    n.text = std::move(module);
    n.name = std::move(name);
    push(add(std::move(n)));
  }
  std::string line(const char* what) {
    for (size_t j = pos_; j < n_ && j - pos_ <= 1024; ++j)
      if (p_[j] == '\n') {
        std::string s(reinterpret_cast<const char*>(p_ + pos_), j - pos_);
        pos_ = j + 1;
        return s;
      }
    fail(op_at_, std::string(what) + " has no end of line within 1024 bytes");
  }
  void memo_put(uint64_t key) {
    if (key > nodes_.size() + 1) fail(op_at_, "memo key " + std::to_string(key) + " is out of range");
    memo_[static_cast<uint32_t>(key)] = top();
  }
  void memo_get(uint64_t key) {
    auto it = memo_.find(static_cast<uint32_t>(key));
    if (key > UINT32_MAX || it == memo_.end())
      fail(op_at_, "memo key " + std::to_string(key) + " was never stored (a malformed pickle)");
    push(it->second);
  }
  void make_tuple(std::vector<uint32_t> items) {
    Node n;
    n.kind = Kind::Tuple;
    n.items = std::move(items);
    push(add(std::move(n)));
  }

  // One opcode; true at STOP. One case per allowed opcode, each a few lines
  // that read its argument and change the stack: the allow-list itself, kept
  // in one place so that what is accepted can be read at a glance.
  bool step(uint8_t op) {
    switch (op) {
      case PROTO: {
        const uint64_t v = le(1, "PROTO");
        if (op_at_ != 0) fail(op_at_, "PROTO after the start");
        if (v < 2 || v > 5) fail(op_at_, "pickle protocol " + std::to_string(v) + " (2 to 5 are read)");
        return false;
      }
      case FRAME: {
        const uint64_t len = le(8, "FRAME");
        if (len > n_ - pos_)
          fail(op_at_, "a frame of " + std::to_string(len) + " bytes runs past the end (" + std::to_string(n_ - pos_) +
                           " bytes left): truncated or corrupt");
        return false;
      }
      case STOP:
        return true;
      case MARK:
        marks_.push_back(stack_.size());
        return false;
      case NONE:
        push(add_kind(Kind::None));
        return false;
      case NEWTRUE:
      case NEWFALSE: {
        Node n;
        n.kind = Kind::Bool;
        n.b = op == NEWTRUE;
        push(add(std::move(n)));
        return false;
      }
      case BININT1:
        push_int(static_cast<int64_t>(le(1, "BININT1")));
        return false;
      case BININT2:
        push_int(static_cast<int64_t>(le(2, "BININT2")));
        return false;
      case BININT:
        push_int(static_cast<int32_t>(static_cast<uint32_t>(le(4, "BININT"))));
        return false;
      case LONG1: {
        const size_t k = static_cast<size_t>(le(1, "LONG1"));
        if (k > 8) fail(op_at_, "an integer of " + std::to_string(k) + " bytes (at most 8 are read)");
        const uint8_t* q = take(k, "LONG1");
        uint64_t v = 0;
        for (size_t j = 0; j < k; ++j) v |= uint64_t{q[j]} << (8 * j);
        if (k > 0 && k < 8 && (q[k - 1] & 0x80)) v |= ~uint64_t{0} << (8 * k);  // sign-extend
        push_int(static_cast<int64_t>(v));
        return false;
      }
      case BINFLOAT: {
        const uint8_t* q = take(8, "BINFLOAT");
        uint64_t bits = 0;
        for (size_t j = 0; j < 8; ++j) bits = (bits << 8) | q[j];  // big-endian
        Node n;
        n.kind = Kind::Float;
        std::memcpy(&n.f, &bits, 8);
        push(add(std::move(n)));
        return false;
      }
      case SHORT_BINUNICODE:
        push_string(le(1, "SHORT_BINUNICODE"));
        return false;
      case BINUNICODE:
        push_string(le(4, "BINUNICODE"));
        return false;
      case BINUNICODE8:
        push_string(le(8, "BINUNICODE8"));
        return false;
      case EMPTY_TUPLE:
        make_tuple({});
        return false;
      case TUPLE1:
      case TUPLE2:
      case TUPLE3: {
        const size_t k = op - TUPLE1 + 1;
        std::vector<uint32_t> items(k);
        for (size_t j = k; j-- > 0;) items[j] = pop();
        make_tuple(std::move(items));
        return false;
      }
      case TUPLE:
        make_tuple(pop_mark());
        return false;
      case EMPTY_LIST:
        push(add_kind(Kind::List));
        return false;
      case EMPTY_DICT:
        push(add_kind(Kind::Dict));
        return false;
      case APPEND: {
        const uint32_t v = pop();
        const uint32_t l = top();
        expect(l, Kind::List, "APPEND's target");
        node(l).items.push_back(v);
        return false;
      }
      case APPENDS: {
        auto items = pop_mark();
        const uint32_t l = top();
        expect(l, Kind::List, "APPENDS' target");
        node(l).items.insert(node(l).items.end(), items.begin(), items.end());
        return false;
      }
      case SETITEM: {
        const uint32_t v = pop();
        const uint32_t k = pop();
        const uint32_t d = top();
        expect(d, Kind::Dict, "SETITEM's target");
        node(d).items.push_back(k);
        node(d).items.push_back(v);
        return false;
      }
      case SETITEMS: {
        auto items = pop_mark();
        if (items.size() % 2) fail(op_at_, "SETITEMS with an odd number of objects (a key without a value)");
        const uint32_t d = top();
        expect(d, Kind::Dict, "SETITEMS' target");
        node(d).items.insert(node(d).items.end(), items.begin(), items.end());
        return false;
      }
      case GLOBAL: {
        std::string module = line("GLOBAL's module");
        std::string name = line("GLOBAL's name");
        push_global(std::move(module), std::move(name));
        return false;
      }
      case STACK_GLOBAL: {
        const uint32_t name = pop();
        const uint32_t module = pop();
        expect(name, Kind::String, "STACK_GLOBAL's name");
        expect(module, Kind::String, "STACK_GLOBAL's module");
        push_global(node(module).text, node(name).text);
        return false;
      }
      case REDUCE:
      case NEWOBJ: {
        const uint32_t args = pop();
        const uint32_t callable = pop();
        expect(args, Kind::Tuple, op == REDUCE ? "REDUCE's arguments" : "NEWOBJ's arguments");
        expect(callable, Kind::Global, op == REDUCE ? "REDUCE's callable" : "NEWOBJ's class");
        Node n;
        n.kind = op == REDUCE ? Kind::Reduce : Kind::Object;
        n.items = {callable, args};
        push(add(std::move(n)));
        return false;
      }
      case BUILD: {
        const uint32_t state = pop();
        const uint32_t obj = top();
        expect(obj, Kind::Object, "BUILD's target");
        if (node(obj).built) fail(op_at_, "BUILD of an object already built");
        node(obj).items.push_back(state);
        node(obj).built = true;
        return false;
      }
      case BINPERSID: {
        Node n;
        n.kind = Kind::PersId;
        n.items = {pop()};
        push(add(std::move(n)));
        return false;
      }
      case MEMOIZE:
        memo_put(memo_.size());
        return false;
      case BINPUT:
        memo_put(le(1, "BINPUT"));
        return false;
      case LONG_BINPUT:
        memo_put(le(4, "LONG_BINPUT"));
        return false;
      case BINGET:
        memo_get(le(1, "BINGET"));
        return false;
      case LONG_BINGET:
        memo_get(le(4, "LONG_BINGET"));
        return false;
      default:
        fail(op_at_, "opcode " + hex(op) + " is not read by this reader");
    }
  }

  const uint8_t* p_;
  size_t n_;
  const Policy& policy_;
  const std::string& where_;
  uint64_t base_;
  std::vector<Node>& nodes_;
  size_t pos_ = 0, op_at_ = 0;
  std::vector<uint32_t> stack_;
  std::vector<size_t> marks_;
  std::unordered_map<uint32_t, uint32_t> memo_;
};

}  // namespace

const char* kind_name(Kind k) {
  switch (k) {
    case Kind::None:
      return "None";
    case Kind::Bool:
      return "bool";
    case Kind::Int:
      return "int";
    case Kind::Float:
      return "float";
    case Kind::String:
      return "str";
    case Kind::Tuple:
      return "tuple";
    case Kind::List:
      return "list";
    case Kind::Dict:
      return "dict";
    case Kind::Global:
      return "global";
    case Kind::Reduce:
      return "call";
    case Kind::Object:
      return "object";
    case Kind::PersId:
      return "persistent id";
  }
  return "?";
}

std::set<uint8_t> data_opcodes() {
  return {PROTO,           FRAME,   STOP,     MARK,        EMPTY_TUPLE, TUPLE1,
          TUPLE2,          TUPLE3,  TUPLE,    EMPTY_LIST,  APPEND,      APPENDS,
          EMPTY_DICT,      SETITEM, SETITEMS, BINUNICODE,  BINUNICODE8, BININT,
          BININT1,         BININT2, LONG1,    BINFLOAT,    NONE,        NEWTRUE,
          NEWFALSE,        MEMOIZE, BINGET,   LONG_BINGET, BINPUT,      LONG_BINPUT,
          SHORT_BINUNICODE};
}

Tree parse(const uint8_t* data, size_t size, const Policy& policy, const std::string& where, uint64_t base) {
  Tree t;
  Parser p(data, size, policy, where, base, t.nodes_);
  t.root_ = p.run();
  return t;
}

Writer& Writer::global(const std::string& module, const std::string& name) {
  out_ += 'c';
  out_ += module;
  out_ += '\n';
  out_ += name;
  out_ += '\n';
  return *this;
}

Writer& Writer::integer(int64_t v) {
  if (v >= 0 && v < 256) {
    out_ += static_cast<char>(BININT1);
    out_ += static_cast<char>(v);
  } else if (v >= INT32_MIN && v <= INT32_MAX) {
    out_ += static_cast<char>(BININT);
    const uint32_t u = static_cast<uint32_t>(static_cast<int32_t>(v));
    for (int j = 0; j < 4; ++j) out_ += static_cast<char>((u >> (8 * j)) & 0xff);
  } else {
    out_ += static_cast<char>(LONG1);
    out_ += static_cast<char>(8);
    const uint64_t u = static_cast<uint64_t>(v);
    for (int j = 0; j < 8; ++j) out_ += static_cast<char>((u >> (8 * j)) & 0xff);
  }
  return *this;
}

Writer& Writer::real(double v) {
  uint64_t bits;
  std::memcpy(&bits, &v, 8);
  out_ += static_cast<char>(BINFLOAT);
  for (int j = 7; j >= 0; --j) out_ += static_cast<char>((bits >> (8 * j)) & 0xff);
  return *this;
}

Writer& Writer::string(const std::string& s) {
  out_ += static_cast<char>(BINUNICODE);
  const uint32_t n = static_cast<uint32_t>(s.size());
  for (int j = 0; j < 4; ++j) out_ += static_cast<char>((n >> (8 * j)) & 0xff);
  out_ += s;
  return *this;
}

std::string Writer::finish() {
  out_ += static_cast<char>(STOP);
  return std::move(out_);
}

}  // namespace shardtorch::checkpoint::pickle
