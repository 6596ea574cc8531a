"""Our GGUF header reader gives what the `gguf` package's reader gives, for the embedded model
and for a file with every value type, and refuses malformed files with a clear error."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import quantize

from sluice.actors.executor.gguf_file import GGUFFile
from sluice.actors.executor.loader import ModelLoadError, open_gguf


def assert_same_as_reference(path) -> GGUFFile:
    ours, reference = GGUFFile(path), GGUFReader(str(path))
    keys = [k for k in reference.fields if not k.startswith("GGUF.")]
    assert list(ours.fields) == keys
    for key in keys:
        expected, mine = reference.fields[key].contents(), ours.fields[key]
        assert type(mine) is type(expected) and mine == expected, key  # bool is not int
    assert [t.name for t in ours.tensors] == [t.name for t in reference.tensors]
    for mine, theirs in zip(ours.tensors, reference.tensors):
        assert mine.tensor_type == theirs.tensor_type
        assert mine.shape == tuple(theirs.shape.tolist())
        assert mine.data.dtype == theirs.data.dtype and mine.data.shape == theirs.data.shape
        assert np.array_equal(mine.data, theirs.data), mine.name
    return ours


def test_the_embedded_model_reads_as_the_reference_reads_it(smollm_path) -> None:
    ours = assert_same_as_reference(smollm_path)
    assert ours.fields["general.architecture"] == "llama"
    assert len(ours.fields["tokenizer.ggml.tokens"]) == 49152


def write_every_kind(path, alignment: int = 64) -> None:
    writer = GGUFWriter(str(path), "llama")
    writer.add_custom_alignment(alignment)
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -100)
    writer.add_uint16("t.u16", 60000)
    writer.add_int16("t.i16", -30000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_float32("t.f32", 0.1)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "pâté ✓")
    writer.add_uint64("t.u64", 2**63 + 5)
    writer.add_int64("t.i64", -(2**62))
    writer.add_float64("t.f64", 1e-300)
    writer.add_array("t.ints", [3, 1, 4, 1, 5])
    writer.add_array("t.floats", [0.5, -2.25])
    writer.add_array("t.strs", ["a", "", "ü b"])
    rng = np.random.default_rng(0)
    writer.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    writer.add_tensor("f16", rng.standard_normal((2, 7)).astype(np.float16))
    q8 = rng.standard_normal((4, 64)).astype(np.float32)
    writer.add_tensor("q8", quantize(q8, GGMLQuantizationType.Q8_0),  # rows of bytes
                      raw_dtype=GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("alignment", [32, 64])
def test_every_value_type_and_tensor_kind_reads_as_the_reference_reads_it(tmp_path,
                                                                          alignment) -> None:
    path = tmp_path / "kinds.gguf"
    write_every_kind(path, alignment)
    ours = assert_same_as_reference(path)
    assert ours.fields["t.strs"] == ["a", "", "ü b"] and ours.fields["t.u64"] == 2**63 + 5


def test_malformed_files_are_refused_naming_the_file_and_the_fault(tmp_path) -> None:
    good = tmp_path / "good.gguf"
    write_every_kind(good)
    data = good.read_bytes()
    for cut in (3, 10, 30, 200, len(data) - 100):  # in the header, a value, the last tensor
        path = tmp_path / f"cut{cut}.gguf"
        path.write_bytes(data[:cut])
        fault = "(truncated|overruns|past the end|magic)"
        with pytest.raises(ModelLoadError, match=f"cut{cut}.gguf.*{fault}"):
            open_gguf(path)
    huge = tmp_path / "huge.gguf"  # a key count no file could hold: refused, not looped over
    huge.write_bytes(data[:8] + (0).to_bytes(8, "little") + (2**62).to_bytes(8, "little"))
    with pytest.raises(ModelLoadError, match="huge.gguf.*count of 4611686018427387904"):
        open_gguf(huge)
    nested = tmp_path / "nested.gguf"  # arrays of arrays 5,000 deep: refused, no recursion
    body = b"".join((9).to_bytes(4, "little") + (1).to_bytes(8, "little") for _ in range(5000))
    key = b"k"
    nested.write_bytes(data[:8] + (0).to_bytes(8, "little") + (1).to_bytes(8, "little")
                       + len(key).to_bytes(8, "little") + key + (9).to_bytes(4, "little")
                       + body + (4).to_bytes(4, "little") + (0).to_bytes(8, "little"))
    with pytest.raises(ModelLoadError, match="nested.gguf.*arrays nest deeper"):
        open_gguf(nested)
    version = tmp_path / "v9.gguf"
    version.write_bytes(data[:4] + (9).to_bytes(4, "little") + data[8:])
    with pytest.raises(ModelLoadError, match="v9.gguf.*version 9"):
        open_gguf(version)


def test_dequantized_values_are_bit_equal_to_the_gguf_packages(smollm_path, tmp_path) -> None:
    from gguf.quants import dequantize as reference

    from sluice.actors.executor.gguf_file import dequantize

    model = GGUFFile(smollm_path)
    kinds = {t.tensor_type for t in model.tensors}
    assert {GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0} <= kinds
    for tensor in model.tensors:  # the embedding spans many pieces of blocks
        ours = dequantize(tensor)
        expected = reference(tensor.data, tensor.tensor_type)
        assert ours.dtype == expected.dtype and ours.shape == expected.shape, tensor.name
        assert np.array_equal(ours, expected), tensor.name
    path = tmp_path / "kinds.gguf"
    write_every_kind(path)
    for tensor in GGUFFile(path).tensors:  # Q8_0 written here, F16 and F32 passed through
        assert np.array_equal(dequantize(tensor), reference(tensor.data, tensor.tensor_type))


def one_tensor_file(path, dims: tuple[int, ...], kind: int) -> None:
    """A GGUF v3 file with no metadata and one tensor named "t", and 4 kB of data."""
    u32, u64 = (lambda v: v.to_bytes(4, "little")), (lambda v: v.to_bytes(8, "little"))
    info = u64(1) + b"t" + u32(len(dims)) + b"".join(u64(d) for d in dims) + u32(kind) + u64(0)
    header = b"GGUF" + u32(3) + u64(1) + u64(0) + info
    path.write_bytes(header + bytes(-len(header) % 32) + bytes(4096))


def test_impossible_tensor_shapes_are_refused_naming_the_tensor(tmp_path) -> None:
    fits = tmp_path / "fits.gguf"
    one_tensor_file(fits, (4, 16), GGMLQuantizationType.F32)
    assert GGUFFile(fits).tensors[0].data.shape == (16, 4)  # valid input is accepted
    huge = tmp_path / "huge.gguf"  # 2**64 + 4 values: wraps to 4 in 64-bit arithmetic
    one_tensor_file(huge, (2**62 + 1, 4), GGMLQuantizationType.F32)
    with pytest.raises(ModelLoadError, match="huge.gguf.*tensor 't' ends past the end"):
        open_gguf(huge)
    rows = tmp_path / "rows.gguf"  # 64 values in all, but rows of 16: not whole 32-blocks
    one_tensor_file(rows, (16, 4), GGMLQuantizationType.Q8_0)
    with pytest.raises(ModelLoadError, match="rows.gguf.*tensor 't': rows of 16"):
        open_gguf(rows)
