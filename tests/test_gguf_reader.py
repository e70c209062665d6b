"""The GGUF reader against the gguf package: metadata, tensor infos, data, and damaged files."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from qml_kernels.ggml_types import GGMLType
from qml_runtime.weights.gguf import GGUFError, GGUFFile

gguf = pytest.importorskip("gguf")


def test_metadata_and_tensors_match_gguf_package(smollm_path):
    ours, theirs = GGUFFile(smollm_path), gguf.GGUFReader(smollm_path)
    for key, field in theirs.fields.items():
        if key.startswith("GGUF."):
            continue
        assert ours.metadata[key] == field.contents(), key
    assert [t.name for t in theirs.tensors] == list(ours.tensors)
    for t in theirs.tensors:
        mine = ours.tensors[t.name]
        assert mine.offset == t.data_offset and mine.nbytes == t.n_bytes
        assert mine.shape == tuple(int(d) for d in reversed(t.shape))
        assert mine.qtype == GGMLType(int(t.tensor_type))
    for t in theirs.tensors[:12]:  # Q8_0 embedding, F32 norms, Q4_1 projections
        expected = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
        assert torch.equal(ours.load(t.name), torch.from_numpy(expected.reshape(ours.tensors[t.name].shape).copy()))


def write_sample(path):
    """A small GGUF with every metadata value type and a few tensor types."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint32("test.u32", 7)
    w.add_int32("test.i32", -3)
    w.add_float32("test.f32", 0.5)
    w.add_float64("test.f64", 0.25)
    w.add_bool("test.bool", True)
    w.add_string("test.str", "héllo")
    w.add_array("test.strs", ["a", "bb", "ccc"])
    w.add_array("test.ints", [1, 2, 3])
    w.add_uint64("test.u64", 2**40)
    w.add_tensor("f32", np.arange(12, dtype=np.float32).reshape(3, 4))
    w.add_tensor("f16", np.linspace(-1, 1, 64, dtype=np.float16).reshape(2, 32))
    q8 = gguf.quants.quantize(np.linspace(-2, 2, 128, dtype=np.float32).reshape(2, 64), gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("q8", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)  # q8 holds the bytes: [2, 68]
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return q8


def test_written_file_roundtrips(tmp_path):
    path = tmp_path / "sample.gguf"
    q8 = write_sample(path)
    f = GGUFFile(path)
    assert f.architecture == "llama"
    assert (f.get("test.u32"), f.get("test.i32"), f.get("test.f32"), f.get("test.f64")) == (7, -3, 0.5, 0.25)
    assert f.get("test.bool") is True and f.get("test.str") == "héllo"
    assert f.get("test.strs") == ["a", "bb", "ccc"] and f.get("test.ints") == [1, 2, 3]
    assert f.get("test.u64") == 2**40
    assert torch.equal(f.load("f32"), torch.arange(12, dtype=torch.float32).reshape(3, 4))
    assert torch.equal(f.load("f16"), torch.from_numpy(np.linspace(-1, 1, 64, dtype=np.float16).reshape(2, 32)).float())
    expected = gguf.quants.dequantize(q8, gguf.GGMLQuantizationType.Q8_0)
    assert f.tensors["q8"].qtype is GGMLType.Q8_0 and f.tensors["q8"].shape == (2, 64)
    assert torch.equal(f.load("q8"), torch.from_numpy(expected))


def test_truncated_file_is_a_clear_error(tmp_path):
    path = tmp_path / "sample.gguf"
    write_sample(path)
    data = path.read_bytes()
    last = max(t.offset for t in GGUFFile(path).tensors.values())
    for cut in (10, 60, last + 1):  # in the counts, in the metadata, in the last tensor's data
        (tmp_path / "cut.gguf").write_bytes(data[:cut])
        with pytest.raises(GGUFError, match="truncated|past the end"):
            GGUFFile(tmp_path / "cut.gguf")


def test_not_a_gguf_file(tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(GGUFError, match="bad magic"):
        GGUFFile(tmp_path / "x.gguf")
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(GGUFError, match="empty"):
        GGUFFile(tmp_path / "empty.gguf")
