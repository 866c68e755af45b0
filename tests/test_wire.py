"""dspark.wire: tensors survive the wire bit for bit, and bad messages are refused."""

import pytest
import torch

from dspark.proto_gen.v1 import tensor_pb2
from dspark.wire import MAX_ELEMENTS, TO_WIRE, WireError, tensor_from_proto, tensor_to_proto

SAMPLES = {
    torch.float32: torch.tensor([[1.5, -2.25, 3.0e-38], [float("inf"), -0.0, 7.0]]),
    torch.float16: torch.tensor([[65504.0, -1.0e-4], [0.5, 3.0]], dtype=torch.float16),
    torch.bfloat16: torch.tensor([[1.0e30, -3.140625], [0.0078125, -7.0]], dtype=torch.bfloat16),
    torch.int32: torch.tensor([[2**31 - 1, -(2**31)], [0, 7]], dtype=torch.int32),
    torch.int64: torch.tensor([[2**62, -1], [49151, 0]], dtype=torch.int64),
    torch.uint8: torch.tensor([[0, 255], [17, 128]], dtype=torch.uint8),
    torch.bool: torch.tensor([[True, False], [False, True]]),
}


def test_every_wire_dtype_has_a_sample():
    assert set(SAMPLES) == set(TO_WIRE)


@pytest.mark.parametrize("dtype", list(SAMPLES), ids=str)
def test_round_trip_is_bit_exact(dtype):
    tensor = SAMPLES[dtype]
    message = tensor_to_proto(tensor)
    # Serialize too: what the peer decodes is the bytes, not our Python object.
    received = tensor_pb2.Tensor.FromString(message.SerializeToString())
    back = tensor_from_proto(received, expected_dtype=dtype, expected_shape=tuple(tensor.shape))
    assert back.dtype == dtype and back.shape == tensor.shape
    assert torch.equal(back.view(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8))


def test_bytes_are_little_endian_raw_values():
    message = tensor_to_proto(torch.tensor([1, 256], dtype=torch.int32))
    assert message.dtype == tensor_pb2.DTYPE_I32
    assert list(message.shape) == [2]
    assert message.data == b"\x01\x00\x00\x00\x00\x01\x00\x00"
    # bf16 1.0 is 0x3F80: the top half of f32 1.0.
    assert tensor_to_proto(torch.tensor([1.0], dtype=torch.bfloat16)).data == b"\x80\x3f"


def test_non_contiguous_scalar_and_empty_tensors():
    strided = torch.arange(24, dtype=torch.float32).reshape(4, 6)[:, ::2]
    assert torch.equal(tensor_from_proto(tensor_to_proto(strided)), strided)
    scalar = tensor_from_proto(tensor_to_proto(torch.tensor(2.5)))
    assert scalar.shape == () and scalar.item() == 2.5
    empty = tensor_from_proto(tensor_to_proto(torch.zeros(0, 5, dtype=torch.bfloat16)))
    assert empty.shape == (0, 5) and empty.dtype == torch.bfloat16


def test_decoded_tensor_owns_writable_memory():
    message = tensor_to_proto(torch.ones(3))
    back = tensor_from_proto(message)
    back += 1  # would warn or fail on a read-only buffer shared with the message
    assert back.tolist() == [2.0, 2.0, 2.0]
    assert tensor_from_proto(message).tolist() == [1.0, 1.0, 1.0]


def test_wildcard_dimension_in_expected_shape():
    hidden = torch.randn(3, 10).to(torch.bfloat16)
    back = tensor_from_proto(tensor_to_proto(hidden), expected_shape=(None, 10))
    assert torch.equal(back, hidden)


def _message(dtype=tensor_pb2.DTYPE_F32, shape=(2, 3), nbytes=24):
    return tensor_pb2.Tensor(dtype=dtype, shape=list(shape), data=b"\x00" * nbytes)


@pytest.mark.parametrize(
    "message, match",
    [
        (_message(nbytes=20), r"20 bytes, but shape \[2, 3\] of torch.float32 needs 6 \* 4 = 24"),
        (_message(nbytes=28), r"28 bytes"),
        (_message(dtype=tensor_pb2.DTYPE_BF16, nbytes=24), r"needs 6 \* 2 = 12"),
        (_message(dtype=tensor_pb2.DTYPE_UNSPECIFIED), r"unknown tensor dtype DTYPE_UNSPECIFIED"),
        (_message(dtype=42), r"unknown tensor dtype 42"),
        (_message(shape=(2, -3)), r"negative dimension in tensor shape \[2, -3\]"),
        (_message(shape=(1 << 20, 1 << 20), nbytes=0), r"over the limit"),
    ],
    ids=["short", "long", "bf16-size", "unspecified-dtype", "unknown-dtype", "negative-dim", "too-big"],
)
def test_malformed_messages_are_refused(message, match):
    with pytest.raises(WireError, match=match):
        tensor_from_proto(message)


def test_expected_dtype_and_shape_are_enforced():
    message = tensor_to_proto(torch.zeros(2, 3))
    with pytest.raises(WireError, match=r"dtype is torch.float32, expected torch.bfloat16"):
        tensor_from_proto(message, expected_dtype=torch.bfloat16)
    with pytest.raises(WireError, match=r"shape is \[2, 3\], expected \[\*, 4\]"):
        tensor_from_proto(message, expected_shape=(None, 4))
    with pytest.raises(WireError, match=r"expected \[2, 3, 1\]"):
        tensor_from_proto(message, expected_shape=(2, 3, 1))


def test_max_elements_is_configurable():
    message = tensor_to_proto(torch.zeros(10))
    assert tensor_from_proto(message, max_elements=10).shape == (10,)
    with pytest.raises(WireError, match="over the limit of 9"):
        tensor_from_proto(message, max_elements=9)
    assert MAX_ELEMENTS >= 1 << 24  # room for a real hidden-state batch


def test_bool_bytes_other_than_0_and_1_are_refused():
    message = tensor_pb2.Tensor(dtype=tensor_pb2.DTYPE_BOOL, shape=[2], data=b"\x01\x02")
    with pytest.raises(WireError, match="bool"):
        tensor_from_proto(message)


def test_wire_error_is_a_value_error():
    assert issubclass(WireError, ValueError)


def test_unsupported_torch_dtype_cannot_be_sent():
    with pytest.raises(WireError, match="cannot send dtype torch.complex64"):
        tensor_to_proto(torch.zeros(2, dtype=torch.complex64))
