// samcache._C: thin pybind11 bindings of the native data structures. The Python classes in
// samcache/cache/ (block_pool.py, content_index.py) validate and convert arguments, then call these.
// Every call that does native work releases the GIL; outputs are numpy arrays allocated before.
//
// The torch.ops.samcache kernels live in the same extension and register themselves at load
// (cpp/bindings/torch_ops.cpp); this file has no torch headers.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>
#include <string>

#include "samcache/block_pool.h"
#include "samcache/content_index.h"
#include "samcache/errors.h"
#include "samcache/parallel_stats.h"
#include "samcache/transfer_engine.h"

namespace py = pybind11;
using namespace samcache;

namespace {

using I32Array = py::array_t<int32_t, py::array::c_style>;
using I64Array = py::array_t<int64_t, py::array::c_style>;

Key128 key_from(const py::bytes& b) {
  std::string_view s = b;
  if (s.size() != sizeof(Key128))
    throw std::invalid_argument("a key is 16 bytes, got " + std::to_string(s.size()));
  Key128 k;
  std::memcpy(&k, s.data(), sizeof(Key128));
  return k;
}

py::bytes to_bytes(const Key128& k) { return py::bytes(reinterpret_cast<const char*>(&k), sizeof(Key128)); }

// Extra-key spans arrive as bounds int64 [K, 2] and keys bytes of length 16 * K.
std::vector<ExtraKeySpan> spans_from(const I64Array& bounds, const py::bytes& keys) {
  std::string_view k = keys;
  // [K, 2] (any K, also 0), or an empty array of another shape meaning no spans; never [K, 0].
  if (bounds.ndim() == 2 ? bounds.shape(1) != 2 : bounds.size() != 0)
    throw std::invalid_argument("span bounds must have shape [K, 2]");
  const size_t n = bounds.ndim() == 2 ? static_cast<size_t>(bounds.shape(0)) : 0;
  if (k.size() != n * sizeof(Key128))
    throw std::invalid_argument("need 16 key bytes per span: " + std::to_string(n) + " spans, " +
                                std::to_string(k.size()) + " bytes");
  std::vector<ExtraKeySpan> out(n);
  const int64_t* b = bounds.data();
  for (size_t i = 0; i < n; ++i) {
    out[i].start = b[2 * i];
    out[i].end = b[2 * i + 1];
    std::memcpy(&out[i].key, k.data() + i * sizeof(Key128), sizeof(Key128));
  }
  return out;
}

py::array_t<int32_t> copies_array(const std::vector<CopyPair>& copies) {
  py::array_t<int32_t> out({static_cast<py::ssize_t>(copies.size()), py::ssize_t{2}});
  if (!copies.empty()) std::memcpy(out.mutable_data(), copies.data(), copies.size() * sizeof(CopyPair));
  return out;
}

template <class T>
py::array_t<T> to_array(const std::vector<T>& v) {
  py::array_t<T> out(static_cast<py::ssize_t>(v.size()));
  if (!v.empty()) std::memcpy(out.mutable_data(), v.data(), v.size() * sizeof(T));
  return out;
}

py::array_t<int32_t> new_slots(const BlockPool& p, int64_t n) {
  if (n < 0) throw std::invalid_argument("cannot append a negative number of slots (" + std::to_string(n) + ")");
  const int64_t capacity = int64_t(p.num_blocks()) * p.block_size();
  if (n > capacity)
    throw OutOfBlocks("appending " + std::to_string(n) + " slots can never fit a pool of " +
                      std::to_string(capacity) + " slots");
  return py::array_t<int32_t>(static_cast<py::ssize_t>(n));
}

py::list evicted_list(const std::vector<EvictedEntry>& ev) {
  py::list out;
  for (const auto& e : ev) out.append(py::make_tuple(to_bytes(e.key), e.entry));
  return out;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "samcache native core: paged block pool, content index, torch.ops.samcache kernels";

  py::register_exception<OutOfBlocks>(m, "OutOfBlocks", PyExc_RuntimeError);
  py::register_exception<CacheFull>(m, "CacheFull", PyExc_RuntimeError);
  py::register_exception<NotFound>(m, "NotFound", PyExc_KeyError);
  py::register_exception<InvariantViolation>(m, "InvariantViolation", PyExc_AssertionError);

  m.def("parallel_stats", &take_parallel_stats, py::arg("reset") = true,
        "(tasks, distinct threads) the CPU kernels' parallel copy loops ran since the last reset");

  py::class_<BlockPool>(m, "BlockPool")
      .def(py::init<int32_t, int32_t>(), py::arg("num_blocks"), py::arg("block_size"))
      .def_property_readonly("num_blocks", &BlockPool::num_blocks)
      .def_property_readonly("block_size", &BlockPool::block_size)
      .def("new_sequence", [](BlockPool& p, const py::bytes& root) { return p.new_sequence(key_from(root)); })
      .def("fork", &BlockPool::fork, py::call_guard<py::gil_scoped_release>())
      .def("share_blocks", &BlockPool::share_blocks, py::call_guard<py::gil_scoped_release>())
      .def("free_sequence", &BlockPool::free_sequence, py::call_guard<py::gil_scoped_release>())
      .def("append_slots",
           [](BlockPool& p, SeqId seq, int64_t n) {
             auto slots = new_slots(p, n);
             std::vector<CopyPair> copies;
             int32_t* out = slots.mutable_data();
             {
               py::gil_scoped_release nogil;
               p.append_slots(seq, n, out, &copies);
             }
             return py::make_tuple(slots, copies_array(copies));
           })
      .def("append_tokens",
           [](BlockPool& p, SeqId seq, const I32Array& tokens, const I64Array& bounds, const py::bytes& keys) {
             if (tokens.ndim() != 1) throw std::invalid_argument("tokens must be 1-D");
             const int64_t n = tokens.shape(0);
             auto spans = spans_from(bounds, keys);
             auto slots = new_slots(p, n);
             std::vector<CopyPair> copies;
             int32_t* out = slots.mutable_data();
             const int32_t* t = tokens.data();
             {
               py::gil_scoped_release nogil;
               p.append_tokens(seq, t, n, spans.data(), spans.size(), out, &copies);
             }
             return py::make_tuple(slots, copies_array(copies));
           })
      .def("match_prefix",
           [](const BlockPool& p, const py::bytes& root, const I32Array& tokens, const I64Array& bounds,
              const py::bytes& keys) {
             if (tokens.ndim() != 1) throw std::invalid_argument("tokens must be 1-D");
             auto spans = spans_from(bounds, keys);
             const Key128 r = key_from(root);
             std::vector<BlockId> blocks;
             {
               py::gil_scoped_release nogil;
               blocks = p.match_prefix(r, tokens.data(), tokens.shape(0), spans.data(), spans.size());
             }
             return to_array(blocks);
           })
      .def("adopt_prefix",
           [](BlockPool& p, SeqId seq, const I32Array& tokens, const I64Array& bounds, const py::bytes& keys) {
             if (tokens.ndim() != 1) throw std::invalid_argument("tokens must be 1-D");
             auto spans = spans_from(bounds, keys);
             py::gil_scoped_release nogil;
             return p.adopt_prefix(seq, tokens.data(), tokens.shape(0), spans.data(), spans.size());
           })
      .def("block_table",
           [](const BlockPool& p, SeqId seq) {
             std::vector<BlockId> t;
             {
               py::gil_scoped_release nogil;
               t = p.block_table(seq);
             }
             return to_array(t);
           })
      .def("num_tokens", &BlockPool::num_tokens)
      .def("num_free_blocks", &BlockPool::num_free_blocks)
      .def("refcount", &BlockPool::refcount)
      .def("block_hash",
           [](const BlockPool& p, BlockId b) -> py::object {
             auto h = p.block_hash(b);
             if (!h) return py::none();
             return to_bytes(*h);
           })
      .def("evict_reporting",
           [](BlockPool& p, int32_t n) {
             std::vector<BlockId> ids;
             std::vector<Key128> hashes;
             {
               py::gil_scoped_release nogil;
               p.evict_reporting(n, &ids, &hashes);
             }
             return py::make_tuple(to_array(ids),
                                   py::bytes(reinterpret_cast<const char*>(hashes.data()), hashes.size() * sizeof(Key128)));
           })
      .def("prefix_hashes",
           [](const BlockPool& p, const py::bytes& root, const I32Array& tokens, const I64Array& bounds,
              const py::bytes& keys) {
             if (tokens.ndim() != 1) throw std::invalid_argument("tokens must be 1-D");
             auto spans = spans_from(bounds, keys);
             const Key128 r = key_from(root);
             std::vector<Key128> hashes;
             {
               py::gil_scoped_release nogil;
               hashes = p.prefix_hashes(r, tokens.data(), tokens.shape(0), spans.data(), spans.size());
             }
             return py::bytes(reinterpret_cast<const char*>(hashes.data()), hashes.size() * sizeof(Key128));
           })
      .def("block_hashes",
           // Many blocks at once (eviction policies check that recorded blocks still hold what they
           // held): 16 bytes a block (zeros where none) and a mask of the blocks that have a hash.
           [](const BlockPool& p, const I32Array& blocks) {
             if (blocks.ndim() != 1) throw std::invalid_argument("blocks must be 1-D");
             const auto n = static_cast<size_t>(blocks.shape(0));
             std::string hashes(n * sizeof(Key128), '\0'), mask(n, '\0');
             {
               py::gil_scoped_release nogil;
               for (size_t i = 0; i < n; ++i) {
                 auto h = p.block_hash(blocks.data()[i]);
                 if (!h) continue;
                 std::memcpy(&hashes[i * sizeof(Key128)], &*h, sizeof(Key128));
                 mask[i] = 1;
               }
             }
             return py::make_tuple(py::bytes(hashes), py::bytes(mask));
           })
      .def("set_block_priority",
           [](BlockPool& p, const I32Array& blocks, int32_t priority) {
             if (blocks.ndim() != 1) throw std::invalid_argument("blocks must be 1-D");
             py::gil_scoped_release nogil;
             p.set_block_priority(blocks.data(), static_cast<size_t>(blocks.shape(0)), priority);
           })
      .def("set_sequence_priority", &BlockPool::set_sequence_priority)
      .def("evict", &BlockPool::evict, py::call_guard<py::gil_scoped_release>())
      .def("check_invariants", &BlockPool::check_invariants, py::call_guard<py::gil_scoped_release>())
      .def("stats", [](const BlockPool& p) {
        BlockPoolStats s = p.stats();
        py::dict d;
        d["num_blocks"] = s.num_blocks;
        d["block_size"] = s.block_size;
        d["free_blocks"] = s.free_blocks;
        d["evictable_blocks"] = s.evictable_blocks;
        d["cached_blocks"] = s.cached_blocks;
        d["live_sequences"] = s.live_sequences;
        d["prefix_queries"] = s.prefix_queries;
        d["prefix_hit_blocks"] = s.prefix_hit_blocks;
        d["evictions"] = s.evictions;
        d["cow_copies"] = s.cow_copies;
        d["eviction_heap_nodes"] = s.eviction_heap_nodes;
        return d;
      });

  py::enum_<Tier>(m, "Tier", "Where an entry's payload lives.")
      .value("DEVICE", Tier::kDevice)
      .value("HOST", Tier::kHost)
      .value("DISK", Tier::kDisk);

  py::class_<ContentEntry>(m, "ContentEntry", "One content index entry (a snapshot; read-only).")
      .def_readonly("handle", &ContentEntry::handle)
      .def_readonly("size_bytes", &ContentEntry::size_bytes)
      .def_readonly("tier", &ContentEntry::tier)
      .def_readonly("pins", &ContentEntry::pins)
      .def_readonly("last_use", &ContentEntry::last_use)
      .def_readonly("priority", &ContentEntry::priority)
      .def("__repr__", [](const ContentEntry& e) {
        return "ContentEntry(handle=" + std::to_string(e.handle) + ", size_bytes=" + std::to_string(e.size_bytes) +
               ", tier=" + std::to_string(int(e.tier)) + ", pins=" + std::to_string(e.pins) +
               ", last_use=" + std::to_string(e.last_use) + ", priority=" + std::to_string(e.priority) + ")";
      });

  py::class_<ContentIndex>(m, "ContentIndex")
      .def(py::init<int64_t>(), py::arg("capacity_bytes"))
      .def_property_readonly("capacity_bytes", &ContentIndex::capacity_bytes)
      .def("get", [](ContentIndex& c, const py::bytes& key) { return c.get(key_from(key)); })
      .def("peek", [](const ContentIndex& c, const py::bytes& key) { return c.peek(key_from(key)); })
      .def("get_many",
           [](ContentIndex& c, const py::bytes& keys) {
             std::string_view k = keys;
             if (k.size() % sizeof(Key128) != 0) throw std::invalid_argument("keys must be 16 bytes each");
             const size_t n = k.size() / sizeof(Key128);
             std::vector<Key128> ks(n);
             if (n) std::memcpy(ks.data(), k.data(), k.size());
             py::array_t<int64_t> out(static_cast<py::ssize_t>(n));
             int64_t* o = out.mutable_data();
             {
               py::gil_scoped_release nogil;
               c.get_many(ks.data(), n, o);
             }
             return out;
           })
      .def("put",
           [](ContentIndex& c, const py::bytes& key, int64_t handle, int64_t size, Tier tier, int32_t priority) {
             std::vector<EvictedEntry> evicted;
             const Key128 k = key_from(key);
             bool inserted;
             {
               py::gil_scoped_release nogil;
               inserted = c.put(k, handle, size, tier, priority, &evicted);
             }
             return py::make_tuple(inserted, evicted_list(evicted));
           })
      .def("remove", [](ContentIndex& c, const py::bytes& key) { return c.remove(key_from(key)); })
      .def("pin", [](ContentIndex& c, const py::bytes& key) { c.pin(key_from(key)); })
      .def("unpin", [](ContentIndex& c, const py::bytes& key) { c.unpin(key_from(key)); })
      .def("set_priority", [](ContentIndex& c, const py::bytes& key, int32_t p) { c.set_priority(key_from(key), p); })
      .def("set_tier", [](ContentIndex& c, const py::bytes& key, Tier t) { c.set_tier(key_from(key), t); })
      .def("evict_until",
           [](ContentIndex& c, int64_t target) {
             std::vector<EvictedEntry> ev;
             {
               py::gil_scoped_release nogil;
               ev = c.evict_until(target);
             }
             return evicted_list(ev);
           })
      .def("check_invariants", &ContentIndex::check_invariants, py::call_guard<py::gil_scoped_release>())
      .def("stats", [](const ContentIndex& c) {
        ContentIndexStats s = c.stats();
        py::dict d;
        d["entries"] = s.entries;
        d["used_bytes"] = s.used_bytes;
        d["pinned_bytes"] = s.pinned_bytes;
        d["capacity_bytes"] = s.capacity_bytes;
        d["hits"] = s.hits;
        d["misses"] = s.misses;
        d["inserts"] = s.inserts;
        d["evictions"] = s.evictions;
        d["eviction_heap_nodes"] = s.eviction_heap_nodes;
        return d;
      });

  py::class_<TransferEngine>(m, "TransferEngine")
      .def(py::init<int>(), py::arg("num_threads"))
      .def(
          "submit",
          [](TransferEngine& e, const std::vector<I64Array>& layers) {
            // Each layer: int64 [n, 3] rows of (source address, destination address, bytes).
            std::vector<std::vector<CopySpan>> spans(layers.size());
            for (std::size_t l = 0; l < layers.size(); ++l) {
              const auto& a = layers[l];
              if (a.ndim() != 2 || (a.shape(0) && a.shape(1) != 3))
                throw std::invalid_argument("each layer's spans are int64 [n, 3] (src, dst, bytes)");
              auto r = a.unchecked<2>();
              for (py::ssize_t i = 0; i < a.shape(0); ++i) {
                if (r(i, 2) < 0) throw std::invalid_argument("a copy span has a negative length");
                spans[l].push_back({reinterpret_cast<const void*>(static_cast<std::uintptr_t>(r(i, 0))),
                                    reinterpret_cast<void*>(static_cast<std::uintptr_t>(r(i, 1))),
                                    static_cast<std::size_t>(r(i, 2))});
              }
            }
            py::gil_scoped_release nogil;
            return e.submit(std::move(spans));
          },
          py::arg("layers"))
      .def("wait", &TransferEngine::wait, py::arg("job"), py::arg("layer"), py::call_guard<py::gil_scoped_release>())
      .def("wait_all", &TransferEngine::wait_all, py::arg("job"), py::call_guard<py::gil_scoped_release>())
      .def("progress", &TransferEngine::progress, py::arg("job"))
      .def("num_layers", &TransferEngine::num_layers, py::arg("job"))
      .def("job_seconds", &TransferEngine::job_seconds, py::arg("job"))
      .def("release", &TransferEngine::release, py::arg("job"), py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("num_threads", &TransferEngine::num_threads)
      .def("stats", [](const TransferEngine& e) {
        TransferStats s = e.stats();
        py::dict d;
        d["jobs"] = s.jobs;
        d["layers"] = s.layers;
        d["bytes"] = s.bytes;
        d["copy_seconds"] = s.copy_seconds;
        d["wait_seconds"] = s.wait_seconds;
        return d;
      });

  m.attr("with_cuda") =
#ifdef SAMCACHE_WITH_CUDA
      true;
#else
      false;
#endif
}
