// The Python module fa2._C, on the limited (abi3) Python API: importing it registers the CUDA ops (ops.cpp, through
// static initialisers); its functions say what was compiled and carry the test-only launch overrides.
#include <Python.h>

#include <algorithm>
#include <string>
#include <vector>

#include "host/state.h"

namespace {

using fa2::host::g_overrides;

PyObject* int_list(const std::vector<int>& values) {
  PyObject* list = PyList_New(0);
  for (int x : values) {
    PyObject* item = PyLong_FromLong(x);
    PyList_Append(list, item);
    Py_DECREF(item);
  }
  return list;
}

void set_item(PyObject* dict, const char* key, PyObject* value) {  // steals value
  PyDict_SetItemString(dict, key, value);
  Py_DECREF(value);
}

std::vector<int> head_dims(const std::vector<fa2::host::Instance>& instances) {
  std::vector<int> dims;
  for (const auto& i : instances) {
    if (std::find(dims.begin(), dims.end(), i.head_dim) == dims.end()) dims.push_back(i.head_dim);
  }
  std::sort(dims.begin(), dims.end());
  return dims;
}

PyObject* build_info(PyObject*, PyObject*) {
  PyObject* info = PyDict_New();
  set_item(info, "version", PyUnicode_FromString(FA2_VERSION));
  set_item(info, "cuda_version", PyUnicode_FromString(FA2_CUDA_VERSION));
  set_item(info, "archs", int_list(fa2::host::built_archs()));
  PyObject* families = PyList_New(0);  // the kernel families compiled (csrc/instantiations/axes.json)
  for (const std::string& family : fa2::host::build_list(FA2_FAMILIES)) {
    PyObject* item = PyUnicode_FromString(family.c_str());
    PyList_Append(families, item);
    Py_DECREF(item);
  }
  set_item(info, "families", families);
  set_item(info, "fwd_head_dims", int_list(head_dims(fa2::host::kFwdInstances)));
  set_item(info, "bwd_head_dims", int_list(head_dims(fa2::host::kBwdInstances)));
  PyObject* dtypes = PyList_New(0);
  for (auto [dtype, name] : {std::pair{fa2::DType::fp16, "fp16"}, std::pair{fa2::DType::bf16, "bf16"}}) {
    const auto& fwd = fa2::host::kFwdInstances;
    if (std::any_of(fwd.begin(), fwd.end(), [&](const auto& i) { return i.dtype == dtype; })) {
      PyObject* item = PyUnicode_FromString(name);
      PyList_Append(dtypes, item);
      Py_DECREF(item);
    }
  }
  set_item(info, "dtypes", dtypes);
  return info;
}

PyObject* set_test_overrides(PyObject*, PyObject* args, PyObject* kwargs) {
  static const char* names[] = {"smem_limit", "head_group", "record", "num_splits", "family", "walk_heads", nullptr};
  int smem_limit = 0, head_group = 0, record = 0, num_splits = 0, walk_heads = 0;
  const char* family = "";
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|iipisi:set_test_overrides", const_cast<char**>(names), &smem_limit,
                                   &head_group, &record, &num_splits, &family, &walk_heads)) {
    return nullptr;
  }
  const std::string f = family;
  if (f != "" && f != "sm80" && f != "sm90") {
    PyErr_SetString(PyExc_ValueError, ("family must be '' (the plan's), 'sm80' or 'sm90', got '" + f + "'").c_str());
    return nullptr;
  }
  if (smem_limit < 0 || head_group < 0 || walk_heads < 0) {
    PyErr_SetString(PyExc_ValueError, "smem_limit, head_group and walk_heads must be >= 0 (0: chosen at launch)");
    return nullptr;
  }
  if (num_splits < 0 || num_splits > fa2::kMaxSplits) {
    PyErr_SetString(PyExc_ValueError, ("num_splits must be in [0, " + std::to_string(fa2::kMaxSplits) +
                                       "] (0: chosen at launch)").c_str());
    return nullptr;
  }
  g_overrides.smem_limit.store(smem_limit);
  g_overrides.head_group.store(head_group);
  g_overrides.num_splits.store(num_splits);
  g_overrides.record.store(record != 0);
  g_overrides.family.store(f == "sm80" ? 1 : f == "sm90" ? 2 : 0);
  g_overrides.walk_heads.store(walk_heads);
  if (record == 0) {
    std::lock_guard<std::mutex> lock(fa2::host::g_recorded_mutex);
    fa2::host::g_recorded.clear();
  }
  Py_RETURN_NONE;
}

const char* family_name(fa2::Family f) { return f == fa2::Family::kSm80 ? "sm80" : "sm90"; }

// A launch plan (csrc/common/plan.h) as a dict: what the tests inspect of the host's decisions.
PyObject* fwd_plan(const fa2::FwdPlan& plan) {
  static const char* tiles[] = {"main", "narrow", "decode"};
  static const char* transforms[] = {"none", "logits", "all"};
  return Py_BuildValue("{s:s,s:i,s:s,s:s,s:(iiii),s:s,s:i,s:O,s:O,s:i,s:O}", "family", family_name(plan.family),
                       "head_dim", plan.head_dim, "dtype", fa2::dtype_name(plan.dtype), "tile",
                       tiles[int(plan.tile)], "shape", plan.shape.block_m, plan.shape.block_n, plan.shape.warps,
                       plan.shape.stages, "transforms", transforms[int(plan.transforms)], "num_splits",
                       plan.num_splits, "pack_gqa", plan.pack_gqa ? Py_True : Py_False, "paged",
                       plan.paged ? Py_True : Py_False, "head_group", plan.head_group, "pdl",
                       plan.pdl ? Py_True : Py_False);
}

PyObject* bwd_plan(const fa2::BwdPlan& plan) {
  static const char* tiles[] = {"main", "deep", "small_smem"};
  return Py_BuildValue("{s:s,s:i,s:s,s:s,s:(iiii),s:i,s:i}", "family", family_name(plan.family), "head_dim",
                       plan.head_dim, "dtype", fa2::dtype_name(plan.dtype), "tile", tiles[int(plan.tile)], "shape",
                       plan.shape.head_dim, plan.shape.block_m, plan.shape.block_n, plan.shape.stages, "head_group",
                       plan.head_group, "walk_heads", plan.walk_heads);
}

PyObject* strides(const fa2::Strides& s) { return Py_BuildValue("(LLL)", s.batch, s.row, s.head); }
PyObject* ptr(const void* p) { return PyLong_FromUnsignedLongLong(reinterpret_cast<uintptr_t>(p)); }

// The launches made in record mode since the last call, as dicts of their parameters (csrc/common/params.h names) and,
// for fwd and bwd, their launch plan under "plan".
PyObject* take_recorded_launches(PyObject*, PyObject*) {
  std::vector<fa2::host::RecordedLaunch> launches;
  {
    std::lock_guard<std::mutex> lock(fa2::host::g_recorded_mutex);
    launches.swap(fa2::host::g_recorded);
  }
  PyObject* list = PyList_New(0);
  for (const auto& l : launches) {
    const fa2::BwdParams& p = l.params;
    PyObject* d = PyDict_New();
    set_item(d, "kind", PyUnicode_FromString(l.kind.c_str()));
    set_item(d, "dtype", PyUnicode_FromString(l.dtype.c_str()));
    set_item(d, "q", ptr(p.q)), set_item(d, "k", ptr(p.k)), set_item(d, "v", ptr(p.v));
    set_item(d, "out", ptr(p.o)), set_item(d, "lse", ptr(p.lse));
    set_item(d, "q_stride", strides(p.q_stride)), set_item(d, "k_stride", strides(p.k_stride));
    set_item(d, "v_stride", strides(p.v_stride)), set_item(d, "out_stride", strides(p.o_stride));
    set_item(d, "batch", PyLong_FromLong(p.batch)), set_item(d, "seqlen_q", PyLong_FromLong(p.seqlen_q));
    set_item(d, "seqlen_k", PyLong_FromLong(p.seqlen_k)), set_item(d, "nheads", PyLong_FromLong(p.nheads));
    set_item(d, "nheads_k", PyLong_FromLong(p.nheads_k)), set_item(d, "head_dim", PyLong_FromLong(p.head_dim));
    set_item(d, "softmax_scale", PyFloat_FromDouble(p.softmax_scale));
    set_item(d, "causal", PyBool_FromLong(p.causal()));
    set_item(d, "window_left", PyLong_FromLong(p.window_left));
    set_item(d, "window_right", PyLong_FromLong(p.window_right));
    set_item(d, "score_scale", PyFloat_FromDouble(p.score_scale));
    set_item(d, "softcap_in", PyFloat_FromDouble(p.softcap_in)), set_item(d, "sink", ptr(p.sink));
    set_item(d, "alibi_slopes", ptr(p.alibi_slopes));
    set_item(d, "alibi_batch_stride", PyLong_FromLong(p.alibi_batch_stride));
    set_item(d, "rng_state", ptr(p.rng_state));
    set_item(d, "dropout_threshold", PyLong_FromUnsignedLong(p.dropout_threshold));
    set_item(d, "dropout_scale", PyFloat_FromDouble(p.dropout_scale));
    set_item(d, "cu_seqlens_q", ptr(p.cu_seqlens_q)), set_item(d, "cu_seqlens_k", ptr(p.cu_seqlens_k));
    set_item(d, "total_q", PyLong_FromLong(p.total_q)), set_item(d, "total_k", PyLong_FromLong(p.total_k));
    set_item(d, "num_splits", PyLong_FromLong(p.num_splits));
    set_item(d, "head_group", PyLong_FromLong(p.head_group));
    if (l.kind == "fwd") set_item(d, "plan", fwd_plan(l.fwd_plan));
    if (l.kind == "bwd") set_item(d, "plan", bwd_plan(l.bwd_plan));
    const fa2::KvCache& c = l.kind == "kv_append" ? l.append.cache : p.cache;
    set_item(d, "cache_seqlens", ptr(c.seqlens)), set_item(d, "cache_seqlen", PyLong_FromLong(c.seqlen));
    set_item(d, "cache_appended", PyLong_FromLong(c.appended));
    set_item(d, "cache_capacity", PyLong_FromLong(c.capacity));
    set_item(d, "cache_batch_index", ptr(c.batch_index)), set_item(d, "cache_batch", PyLong_FromLong(c.cache_batch));
    set_item(d, "block_table", ptr(c.block_table));
    set_item(d, "block_table_stride", PyLong_FromLong(c.block_table_stride));
    set_item(d, "page_size", PyLong_FromLong(c.page_size)), set_item(d, "cache_leftpad", ptr(c.leftpad));
    if (l.kind == "kv_append") {
      const fa2::KvAppendParams& a = l.append;
      set_item(d, "k_new", ptr(a.k_new)), set_item(d, "v_new", ptr(a.v_new));
      set_item(d, "k_cache", ptr(a.k_cache)), set_item(d, "v_cache", ptr(a.v_cache));
      set_item(d, "k_new_stride", strides(a.k_new_stride)), set_item(d, "v_new_stride", strides(a.v_new_stride));
      set_item(d, "k_cache_stride", strides(a.k_cache_stride));
      set_item(d, "v_cache_stride", strides(a.v_cache_stride));
      set_item(d, "batch", PyLong_FromLong(a.batch)), set_item(d, "seqlen_new", PyLong_FromLong(a.seqlen_new));
      set_item(d, "nheads_k", PyLong_FromLong(a.nheads_k)), set_item(d, "row_bytes", PyLong_FromLong(a.row_bytes));
      set_item(d, "rotary_dim", PyLong_FromLong(a.rotary_dim)), set_item(d, "seqlen_ro", PyLong_FromLong(a.seqlen_ro));
      set_item(d, "rotary_interleaved", PyBool_FromLong(a.interleaved));
      set_item(d, "rotary_q_per_row", PyBool_FromLong(a.q_per_row)), set_item(d, "rotary_bf16", PyBool_FromLong(a.bf16));
      set_item(d, "rotary_cos", ptr(a.rotary_cos)), set_item(d, "rotary_sin", ptr(a.rotary_sin));
      set_item(d, "q", ptr(a.q)), set_item(d, "q_rotated", ptr(a.q_rotated));
      set_item(d, "q_stride", strides(a.q_stride)), set_item(d, "q_rotated_stride", strides(a.q_rotated_stride));
      set_item(d, "seqlen_q", PyLong_FromLong(a.seqlen_q)), set_item(d, "nheads", PyLong_FromLong(a.nheads));
    }
    if (l.kind == "bwd") {
      set_item(d, "dout", ptr(p.dout)), set_item(d, "dq", ptr(p.dq)), set_item(d, "dk", ptr(p.dk));
      set_item(d, "dv", ptr(p.dv)), set_item(d, "dq_accum", ptr(p.dq_accum)), set_item(d, "d_sum", ptr(p.d_sum));
      set_item(d, "dout_stride", strides(p.dout_stride)), set_item(d, "dq_stride", strides(p.dq_stride));
      set_item(d, "dk_stride", strides(p.dk_stride)), set_item(d, "dv_stride", strides(p.dv_stride));
      set_item(d, "deterministic", PyBool_FromLong(p.deterministic));
      set_item(d, "dkv_fp32", PyBool_FromLong(p.dkv_fp32));
    }
    PyList_Append(list, d);
    Py_DECREF(d);
  }
  return list;
}

PyMethodDef methods[] = {
    {"build_info", build_info, METH_NOARGS,
     "What this build compiled: version, cuda_version, archs, families, head dims, dtypes."},
    {"set_test_overrides", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(set_test_overrides)),
     METH_VARARGS | METH_KEYWORDS,
     "Test only (csrc/CONTRACT.md): launch parameters for every later call; set_test_overrides() resets them."},
    {"take_recorded_launches", take_recorded_launches, METH_NOARGS,
     "Test only: the launches recorded since the last call (set_test_overrides(record=True))."},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C",
                      "fa2's CUDA kernels: importing this module registers the torch.ops.fa2 kernels. Use the fa2 "
                      "package, not this module.",
                      -1, methods};

}  // namespace

extern "C" PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&module); }
