"""What a verifier is told about its drafter (DrafterInfoResponse): the same for a drafter service
and for a drafter that runs inside the verifier."""
from __future__ import annotations

import torch

from dspark.proto_gen.v1 import drafter_pb2
from dspark.wire import tensor_to_proto


def drafter_info(drafter, target_model: str, sts_temperatures=None) -> drafter_pb2.DrafterInfoResponse:
    """sts_temperatures: the checkpoint's offline STS fit ([gamma]), or None."""
    info = drafter_pb2.DrafterInfoResponse(
        kind=drafter.kind, version=drafter.version, gamma=drafter.gamma, target_layers=drafter.ctx_layers,
        hidden_size=drafter.cfg.hidden_size, target_model=target_model, has_confidence=drafter.has_confidence,
        drafts_ahead=drafter.drafts_ahead)
    if sts_temperatures is not None:
        info.sts_temperatures.CopyFrom(tensor_to_proto(torch.tensor(sts_temperatures, dtype=torch.float32)))
    return info
