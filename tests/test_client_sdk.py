"""dspark_client against a real grpc.aio server that fakes the Generation service.

The server is a test double (the real verifier is built elsewhere): it streams the prompt's
words back, one token per word, and can be told to fail, stall or break off mid-stream.
"""

import asyncio
import datetime
import ipaddress
import subprocess
import sys
import time
from contextlib import asynccontextmanager

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from dspark_client import (AsyncClient, ChatMessage, Client, DeadlineExceeded, DSparkError, FinishReason, RetryPolicy,
                           TlsConfig, Unavailable, build_request)
from dspark_client.proto_gen.v1 import generation_pb2 as pb
from dspark_client.proto_gen.v1 import generation_pb2_grpc

FAST_RETRY = RetryPolicy(max_attempts=3, initial_backoff=0.01, max_backoff=0.05)


class FakeGeneration(generation_pb2_grpc.GenerationServicer):
    def __init__(self, fail_first: int = 0, break_after: int | None = None, delay: float = 0.0):
        self.fail_first = fail_first    # abort this many calls with UNAVAILABLE before any token
        self.break_after = break_after  # abort with UNAVAILABLE after streaming this many tokens
        self.delay = delay              # seconds before each chunk
        self.calls = 0
        self.requests: list[pb.GenerateRequest] = []
        self.metadata: list[dict[str, str]] = []

    @staticmethod
    def reply_words(request: pb.GenerateRequest) -> list[str]:
        kind = request.WhichOneof("prompt")
        if kind == "text":
            return ["echo:", *request.text.split()]
        if kind == "token_ids":
            return [f"t{i}" for i in request.token_ids.ids]
        users = [m for m in request.messages.messages if m.role == "user"]
        return [f"turn{len(users)}:", *users[-1].content.split()]

    async def Generate(self, request, context):
        self.calls += 1
        self.requests.append(request)
        self.metadata.append(dict(context.invocation_metadata()))
        if request.max_tokens > 4096:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "max_tokens over 4096")
        if self.calls <= self.fail_first:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "verifier warming up")
        words = self.reply_words(request)
        limit = request.max_tokens or len(words)
        out = words[:limit]
        for i, word in enumerate(out):
            if self.break_after is not None and i == self.break_after:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "verifier lost")
            await asyncio.sleep(self.delay)
            chunk = pb.GenerateChunk(request_id="req-1", token_ids=[100 + i], text=word + " ", offset=i)
            if i == len(out) - 1:
                chunk.finish_reason = pb.FINISH_REASON_LENGTH if limit < len(words) else pb.FINISH_REASON_STOP
                chunk.metrics.CopyFrom(pb.SpecMetrics(
                    prompt_tokens=3, generated_tokens=len(out), steps=2, drafts=2, draft_tokens=6,
                    accepted_tokens=max(0, len(out) - 2), tau=len(out) / 2,
                    verified_per_position=[2, 2, 2], accepted_per_position=[2, 1, 0],
                ))
            yield chunk

    async def ListModels(self, request, context):
        return pb.ListModelsResponse(models=[pb.ModelInfo(name="smollm2-135m", drafter="dspark", gamma=7)])


@asynccontextmanager
async def serving(servicer, credentials=None):
    server = grpc.aio.server()
    generation_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
    if credentials is None:
        port = server.add_insecure_port("127.0.0.1:0")
    else:
        port = server.add_secure_port("127.0.0.1:0", credentials)
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(0)


async def run_cli(*args: str, stdin: str = "") -> subprocess.CompletedProcess:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "dspark_client", *args,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(stdin.encode()), timeout=60)
    return subprocess.CompletedProcess(args, proc.returncode, out.decode(), err.decode())


# ---- streaming and whole results -------------------------------------------------------------

async def test_async_stream_yields_typed_chunks_in_order():
    fake = FakeGeneration()
    async with serving(fake) as address, AsyncClient(address) as client:
        chunks = [c async for c in client.generate_stream("hello speculative world")]
    assert [c.text for c in chunks] == ["echo: ", "hello ", "speculative ", "world "]
    assert [c.token_ids for c in chunks] == [(100,), (101,), (102,), (103,)]
    assert [c.offset for c in chunks] == [0, 1, 2, 3]
    assert [c.finish_reason for c in chunks] == [None, None, None, FinishReason.STOP]
    assert chunks[0].metrics is None and chunks[-1].metrics.tau == 2.0


async def test_async_generate_returns_result_and_sends_every_parameter():
    fake = FakeGeneration()
    async with serving(fake) as address, AsyncClient(address, metadata=[("tenant", "t1")]) as client:
        result = await client.generate(
            "a b c", model="smollm2", temperature=0.7, top_p=0.8, top_k=20, seed=0, max_tokens=9,
            stop=["\n\n"], stop_token_ids=[2], max_draft_tokens=4, metadata=[("traceparent", "00-abc-def-01")],
        )
        models = await client.list_models()
    assert result.text == "echo: a b c " and result.token_ids == (100, 101, 102, 103)
    assert result.finish_reason == FinishReason.STOP and result.request_id == "req-1"
    m = result.metrics
    assert (m.generated_tokens, m.steps, m.draft_tokens, m.accepted_tokens, m.tau) == (4, 2, 6, 2, 2.0)
    assert m.accepted_per_position == (2, 1, 0) and m.verified_per_position == (2, 2, 2)
    sent = fake.requests[0]
    assert sent.model == "smollm2" and sent.max_tokens == 9
    assert sent.sampling.temperature == pytest.approx(0.7) and sent.sampling.top_p == pytest.approx(0.8)
    assert sent.sampling.top_k == 20 and sent.sampling.HasField("seed") and sent.sampling.seed == 0
    assert list(sent.stop) == ["\n\n"] and list(sent.stop_token_ids) == [2]
    assert not sent.speculation.disable and sent.speculation.max_draft_tokens == 4
    assert sent.stream_interval_ms == 500  # generate(): the whole answer, chunked upstream
    assert fake.metadata[0]["tenant"] == "t1" and fake.metadata[0]["traceparent"] == "00-abc-def-01"
    assert [model.name for model in models] == ["smollm2-135m"]


async def test_sync_client_streams_chat_and_token_prompts():
    fake = FakeGeneration()

    def use_sync_client(address):
        with Client(address) as client:
            chat = list(client.generate_stream(
                messages=[ChatMessage("system", "be brief"), {"role": "user", "content": "hi there"}]))
            tokens = client.generate(token_ids=[5, 6], max_tokens=1, speculation=False)
        return chat, tokens

    async with serving(fake) as address:
        chat, tokens = await asyncio.to_thread(use_sync_client, address)
    assert "".join(c.text for c in chat) == "turn1: hi there "
    sent = [(m.role, m.content) for m in fake.requests[0].messages.messages]
    assert sent == [("system", "be brief"), ("user", "hi there")]
    assert tokens.text == "t5 " and tokens.finish_reason == FinishReason.LENGTH
    assert list(fake.requests[1].token_ids.ids) == [5, 6] and fake.requests[1].speculation.disable
    # A stream asks for every step's chunk; generate() reads the whole answer and lets tokens gather.
    assert fake.requests[0].stream_interval_ms == 0 and fake.requests[1].stream_interval_ms == 500


def test_request_needs_exactly_one_prompt_kind():
    with pytest.raises(ValueError, match="exactly one of prompt, messages, token_ids"):
        build_request("x", token_ids=[1])
    with pytest.raises(ValueError, match="got none"):
        build_request()
    assert build_request(messages=[]).WhichOneof("prompt") == "messages"


# ---- deadlines, retries, errors --------------------------------------------------------------

async def test_deadline_exceeded_is_a_clear_error():
    fake = FakeGeneration(delay=5.0)
    async with serving(fake) as address, AsyncClient(address, retry=FAST_RETRY) as client:
        start = time.monotonic()
        within = r"deadline exceeded: no complete answer from .* within 0.3 s \(0 tokens received\)"
        with pytest.raises(DeadlineExceeded, match=within) as info:
            await client.generate("slow", timeout=0.3)
        assert time.monotonic() - start < 3.0
    assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert fake.calls == 1  # a deadline is not retried


async def test_sync_deadline_exceeded():
    fake = FakeGeneration(delay=5.0)

    def call(address):
        with Client(address, timeout=0.3) as client:
            client.generate("slow")

    async with serving(fake) as address:
        with pytest.raises(DeadlineExceeded, match="within 0.3 s"):
            await asyncio.to_thread(call, address)


async def test_unavailable_before_first_token_is_retried():
    fake = FakeGeneration(fail_first=2)
    async with serving(fake) as address, AsyncClient(address, retry=FAST_RETRY) as client:
        result = await client.generate("x y")
    assert result.text == "echo: x y " and fake.calls == 3


async def test_retries_give_up_after_max_attempts():
    fake = FakeGeneration(fail_first=10)
    policy = RetryPolicy(max_attempts=2, initial_backoff=0.01)
    async with serving(fake) as address, AsyncClient(address, retry=policy) as client:
        with pytest.raises(Unavailable, match="verifier warming up") as info:
            await client.generate("x")
    assert fake.calls == 2 and info.value.tokens_received == 0


async def test_unavailable_after_a_token_is_not_retried():
    fake = FakeGeneration(break_after=1)
    received = []
    async with serving(fake) as address, AsyncClient(address, retry=FAST_RETRY) as client:
        with pytest.raises(Unavailable, match="after 1 tokens received; not retried") as info:
            async for chunk in client.generate_stream("one two three"):
                received.append(chunk.text)
    assert received == ["echo: "] and info.value.tokens_received == 1
    assert fake.calls == 1


async def test_with_replicas_a_broken_stream_resumes_on_the_next_after_its_last_token():
    broken, healthy = FakeGeneration(break_after=2), FakeGeneration()
    async with serving(broken) as first, serving(healthy) as second:
        async with AsyncClient([first, second], retry=FAST_RETRY) as client:
            chunks = [c async for c in client.generate_stream("one two three")]
        assert [c.text for c in chunks][:2] == ["echo: ", "one "]  # from the first replica

        def sync_stream():  # in a thread: the fake servers run on this event loop
            with Client(f"{first},{second}", retry=FAST_RETRY) as client:
                return list(client.generate_stream("one two three"))
        sync_chunks = await asyncio.to_thread(sync_stream)
    assert [c.text for c in sync_chunks][:2] == ["echo: ", "one "]
    # The second replica was asked to go on after what the caller already had.
    resumed = [r for r in healthy.requests if r.HasField("resume")]
    assert len(resumed) == 2
    for request in resumed:
        assert list(request.resume.streamed_token_ids) == [100, 101]
        assert request.resume.streamed_text == "echo: one "
        assert request.text == "one two three"  # the same request otherwise


async def test_sync_client_retries_only_before_the_first_token():
    def generate(address, **kwargs):
        with Client(address, retry=FAST_RETRY) as client:
            return client.generate("p q", **kwargs)

    flaky = FakeGeneration(fail_first=1)
    async with serving(flaky) as address:
        assert (await asyncio.to_thread(generate, address)).text == "echo: p q "
    assert flaky.calls == 2

    broken = FakeGeneration(break_after=2)
    async with serving(broken) as address:
        with pytest.raises(Unavailable, match="after 2 tokens"):
            await asyncio.to_thread(generate, address)
    assert broken.calls == 1


async def test_other_errors_are_not_retried():
    fake = FakeGeneration()
    async with serving(fake) as address, AsyncClient(address, retry=FAST_RETRY) as client:
        with pytest.raises(DSparkError, match="INVALID_ARGUMENT from .*: max_tokens over 4096") as info:
            await client.generate("x", max_tokens=5000)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT and fake.calls == 1


async def test_server_down_is_unavailable():
    policy = RetryPolicy(max_attempts=2, initial_backoff=0.01)
    async with AsyncClient("127.0.0.1:1", retry=policy) as client:
        with pytest.raises(Unavailable, match="127.0.0.1:1 unavailable"):
            await client.generate("x", timeout=5)


# ---- TLS -------------------------------------------------------------------------------------

def _certificate(subject: str, key, issuer_name, issuer_key, *, ca=False, usage=None, san=None):
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
        .issuer_name(issuer_name or x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if usage:
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    if san:
        builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
    return builder.sign(issuer_key or key, hashes.SHA256())


def _pem(cert) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _key_pem(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A throwaway CA, a server certificate for dspark.test / 127.0.0.1, and a client certificate."""
    ca_key, server_key, client_key = (ec.generate_private_key(ec.SECP256R1()) for _ in range(3))
    ca = _certificate("dspark test CA", ca_key, None, None, ca=True)
    server = _certificate(
        "dspark.test", server_key, ca.subject, ca_key, usage=ExtendedKeyUsageOID.SERVER_AUTH,
        san=[x509.DNSName("dspark.test"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))],
    )
    client = _certificate("dspark client", client_key, ca.subject, ca_key, usage=ExtendedKeyUsageOID.CLIENT_AUTH)
    folder = tmp_path_factory.mktemp("pki")
    files = {"ca": _pem(ca), "server": _pem(server), "server_key": _key_pem(server_key),
             "client": _pem(client), "client_key": _key_pem(client_key)}
    for name, data in files.items():
        (folder / f"{name}.pem").write_bytes(data)
    return {name: folder / f"{name}.pem" for name in files}


def _mtls_server_credentials(pki):
    return grpc.ssl_server_credentials(
        [(pki["server_key"].read_bytes(), pki["server"].read_bytes())],
        root_certificates=pki["ca"].read_bytes(), require_client_auth=True,
    )


async def test_mutual_tls(pki):
    fake = FakeGeneration()
    tls = TlsConfig.from_files(pki["ca"], pki["client"], pki["client_key"], server_name="dspark.test")
    async with serving(fake, _mtls_server_credentials(pki)) as address:
        async with AsyncClient(address, tls=tls) as client:
            assert (await client.generate("secure hello")).text == "echo: secure hello "
        # Without a client certificate the server refuses the handshake: no call reaches it.
        no_cert = TlsConfig.from_files(pki["ca"], server_name="dspark.test")
        async with AsyncClient(address, tls=no_cert, retry=RetryPolicy(max_attempts=1)) as client:
            with pytest.raises(Unavailable):
                await client.generate("x", timeout=5)
        # Plaintext against a TLS port fails the same way.
        async with AsyncClient(address, retry=RetryPolicy(max_attempts=1)) as client:
            with pytest.raises(Unavailable):
                await client.generate("x", timeout=5)
        # The CLI takes the same certificates as flags.
        done = await run_cli(
            "generate", "cli over tls", "--address", address, "--root-certs", str(pki["ca"]),
            "--client-cert", str(pki["client"]), "--client-key", str(pki["client_key"]), "--server-name", "dspark.test",
        )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "echo: cli over tls \n"
    assert fake.calls == 2


def test_tls_config_needs_cert_and_key_together(pki):
    with pytest.raises(ValueError, match="both certificate_chain and private_key"):
        TlsConfig.from_files(pki["ca"], certificate_chain=pki["client"])


# ---- CLI and packaging -----------------------------------------------------------------------

async def test_cli_generate_prints_text_and_metrics():
    fake = FakeGeneration()
    async with serving(fake) as address:
        streamed = await run_cli("generate", "hi from the cli", "--address", address, "--temperature", "0.5", "--seed", "7")
        whole = await run_cli("generate", "hi", "--address", address, "--no-stream", "--metrics", "--max-tokens", "1")
    assert streamed.returncode == 0, streamed.stderr
    assert streamed.stdout == "echo: hi from the cli \n"
    assert fake.requests[0].sampling.temperature == pytest.approx(0.5) and fake.requests[0].sampling.seed == 7
    assert whole.returncode == 0 and whole.stdout == "echo: \n"
    assert "1 tokens, 2 steps, tau 0.50" in whole.stderr and "finish length" in whole.stderr


async def test_cli_chat_keeps_the_history():
    fake = FakeGeneration()
    async with serving(fake) as address:
        done = await run_cli("chat", "--address", address, "--system", "be kind", stdin="hello\n\nagain please\n/exit\n")
    assert done.returncode == 0, done.stderr
    assert done.stdout == "turn1: hello \nturn2: again please \n"
    second = [(m.role, m.content) for m in fake.requests[1].messages.messages]
    assert second == [("system", "be kind"), ("user", "hello"), ("assistant", "turn1: hello "), ("user", "again please")]


async def test_cli_reports_an_unreachable_server():
    done = await run_cli("generate", "x", "--address", "127.0.0.1:1", "--retries", "1", "--timeout", "5")
    assert done.returncode == 1
    assert "error: server at 127.0.0.1:1 unavailable" in done.stderr


def test_client_package_imports_neither_torch_nor_the_server_package():
    code = "import sys, dspark_client, dspark_client.cli; bad = {'torch', 'dspark'} & set(sys.modules); assert not bad, bad"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
