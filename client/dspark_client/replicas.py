"""The scheduler replicas a client talks to: one channel and one Generation stub per address
("a:50051,b:50051" or a list), in order. Attempts after a failure go to the next one."""

from collections.abc import Sequence

from .channel import split_addresses
from .proto_gen.v1 import generation_pb2_grpc


class Replicas:
    def __init__(self, address: str | Sequence[str], open_channel, tls, options):
        self.addresses = split_addresses(address)
        self.address = ",".join(self.addresses)
        self.channels = [open_channel(a, tls, options) for a in self.addresses]
        self.stubs = [generation_pb2_grpc.GenerationStub(c) for c in self.channels]
