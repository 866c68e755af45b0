import pytest
import torch

from dspark.drafters import DrafterConfig, build_drafter
from dspark.drafters.checkpoint import load_drafter, save_drafter
from dspark.drafters.context_kv import ContextKV
from dspark.kernels.cpu import kernels
from dspark.models.batch import VarlenBatch

CTX_LAYERS = [1, 2]
GAMMA = 4


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target(tiny_llama):
    return tiny_llama


@pytest.fixture(scope="module")
def sequence(target):
    tokens = torch.randint(0, 64, (24,), generator=torch.Generator().manual_seed(1))
    out = target(VarlenBatch.build([tokens.tolist()], [0]), capture_layers=CTX_LAYERS, logits_rows=None)
    return tokens, out.features


def make(target, kind, seed=0, **overrides):
    torch.manual_seed(seed)
    fields = dict(gamma=GAMMA, markov_rank=16, support_size=4)
    fields.update(overrides)
    cfg = DrafterConfig.for_target(target.config, kind, CTX_LAYERS, **fields)
    size = overrides.get("draft_vocab_size")
    draft_vocab = torch.arange(0, 64, 2)[:size] if size else None  # every other token: not a prefix of arange
    drafter = build_drafter(cfg, target.model.embed_tokens.weight, target.lm_head.weight, draft_vocab=draft_vocab)
    with torch.no_grad():  # zero-initialised heads would hide bugs: randomise everything
        for p in drafter.parameters():
            p.normal_(0, 0.3)
    return drafter.eval()


KINDS = [("dspark", {}), ("dspark", {"head": "rnn"}), ("dflash", {}), ("eagle3", {}),
         ("dspark", {"draft_vocab_size": 24}), ("dspark", {"draft_vocab_size": 24, "markov_table": "compact"}),
         ("dspark", {"head": "rnn", "markov_table": "compact"})]


@pytest.mark.parametrize("kind,overrides", KINDS)
def test_training_forward_equals_inference(target, sequence, kind, overrides):
    tokens, features = sequence
    drafter = make(target, kind, **overrides)
    anchor = 13
    drafter.extend_context("r", features[:anchor], tokens[:anchor])
    forced = tokens[anchor + 1:anchor + 1 + GAMMA][None]
    block = drafter.draft(["r"], tokens[anchor:anchor + 1], torch.zeros(1), [None], forced_tokens=forced,
                          return_logits=True)
    with torch.no_grad():
        if kind == "eagle3":  # step j of the unrolled chain that starts at position anchor-1
            hidden = drafter.train_forward(features, tokens, GAMMA)
            train_logits = torch.stack([drafter.draft_logits(hidden[j, anchor - 1 + j]) for j in range(GAMMA)])
        else:  # the block at `anchor` among other blocks of the same sequence
            logits, conf = drafter.train_forward(features, tokens, torch.tensor([2, anchor, 20]))
            train_logits = logits[1]
            if kind == "dspark":
                torch.testing.assert_close(conf[1], block.conf_logits[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(train_logits, block.logits[0], atol=1e-4, rtol=1e-4)
    assert torch.equal(block.tokens[0], forced[0])
    # Greedy drafting picks the argmax of the same logits when fed its own tokens.
    greedy = drafter.draft(["r"], tokens[anchor:anchor + 1], torch.zeros(1), [None], return_logits=True)
    again = drafter.draft(["r"], tokens[anchor:anchor + 1], torch.zeros(1), [None], forced_tokens=greedy.tokens,
                          return_logits=True)
    assert torch.equal(drafter.draft_vocab[again.logits[0].argmax(-1)], greedy.tokens[0])


@pytest.mark.parametrize("kind", ["dspark", "dflash"])
def test_block_never_sees_context_at_or_after_its_anchor(target, sequence, kind):
    tokens, features = sequence
    drafter = make(target, kind)
    anchor = 10
    with torch.no_grad():
        base, _ = drafter.train_forward(features, tokens, torch.tensor([anchor]))
        later = features.clone()
        later[anchor:] += 5.0
        same, _ = drafter.train_forward(later, tokens, torch.tensor([anchor]))
        earlier = features.clone()
        earlier[anchor - 1] += 5.0
        changed, _ = drafter.train_forward(earlier, tokens, torch.tensor([anchor]))
    torch.testing.assert_close(base, same)
    assert (base - changed).abs().max() > 1e-3


def _draft_seeded(drafter, req_ids, anchors, seed=5):
    gens = [torch.Generator().manual_seed(seed + i) for i in range(len(req_ids))]
    return drafter.draft(req_ids, anchors, torch.ones(len(req_ids)), gens)


def _assert_same_block(a, b):
    assert torch.equal(a.tokens, b.tokens)
    assert torch.equal(a.support_ids, b.support_ids)
    torch.testing.assert_close(a.support_probs, b.support_probs, atol=1e-5, rtol=1e-5)
    if a.conf_logits is not None:
        torch.testing.assert_close(a.conf_logits, b.conf_logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["dspark", "dflash", "eagle3"])
def test_drafting_after_rollback_equals_fresh_context(target, sequence, kind):
    tokens, features = sequence
    drafter = make(target, kind)
    drafter.extend_context("r", features[:7], tokens[:7])  # in pieces, with drafts in between
    _draft_seeded(drafter, ["r"], tokens[7:8])
    drafter.extend_context("r", features[7:16], tokens[7:16])
    _draft_seeded(drafter, ["r"], tokens[16:17])
    drafter.rollback("r", 10)
    assert drafter.context_len("r") == 10
    # Different tokens after the rollback point: nothing built from the old ones may survive.
    replaced = torch.cat([tokens[:10], (tokens[10:12] + 1) % 64])
    drafter.extend_context("r", features[10:12], replaced[10:12])
    after = _draft_seeded(drafter, ["r"], tokens[12:13])
    drafter.extend_context("fresh", features[:12], replaced)
    fresh = _draft_seeded(drafter, ["fresh"], tokens[12:13])
    _assert_same_block(after, fresh)
    drafter.release("r")
    assert drafter.context_len("r") == 0


@pytest.mark.parametrize("kind", ["dspark", "dflash", "eagle3"])
def test_warm_up_leaves_no_context_and_changes_no_draft(target, sequence, kind):
    """What a service runs before SERVING: the caches of a first draft built, nothing else changed."""
    tokens, features = sequence
    cold, warm = make(target, kind), make(target, kind)
    warm.warm_up()
    assert warm.context_len("__warm_up__") == 0
    if kind == "dspark":
        assert "_token_biases" in warm.__dict__  # DSpark's bias table, built by the throwaway draft
    for drafter in (cold, warm):
        drafter.extend_context("r", features[:12], tokens[:12])
    _assert_same_block(_draft_seeded(warm, ["r"], tokens[12:13]), _draft_seeded(cold, ["r"], tokens[12:13]))


@pytest.mark.parametrize("kind", ["dspark", "dflash", "eagle3"])
def test_batched_drafting_equals_one_by_one(target, sequence, kind):
    tokens, features = sequence
    drafter = make(target, kind)
    lengths = {"a": 5, "b": 17, "c": 11}
    for req, n in lengths.items():
        drafter.extend_context(req, features[:n], tokens[:n])
    anchors = torch.stack([tokens[n] for n in lengths.values()])
    batched = _draft_seeded(drafter, list(lengths), anchors)
    for i, req in enumerate(lengths):
        gens = [torch.Generator().manual_seed(5 + i)]
        single = drafter.draft([req], anchors[i:i + 1], torch.ones(1), gens)
        assert torch.equal(single.tokens[0], batched.tokens[i])
        torch.testing.assert_close(single.support_probs[0], batched.support_probs[i], atol=1e-5, rtol=1e-5)


def test_draft_block_shapes_and_exact_support(target, sequence):
    tokens, features = sequence
    drafter = make(target, "dspark", draft_vocab_size=24)
    for req in ("x", "y"):
        drafter.extend_context(req, features[:9], tokens[:9])
    block = drafter.draft(["x", "y"], tokens[9:11], torch.tensor([1.0, 0.0]),
                          [torch.Generator().manual_seed(0), None])
    assert block.tokens.shape == (2, GAMMA) and block.tokens.dtype == torch.int64
    assert block.conf_logits.shape == (2, GAMMA) and block.conf_logits.dtype == torch.float32
    assert block.support_ids.shape == (2, GAMMA, 4) and block.support_probs.shape == (2, GAMMA, 4)
    torch.testing.assert_close(block.support_probs.sum(-1), torch.ones(2, GAMMA))
    assert (block.support_ids == block.tokens[..., None]).any(-1).all()  # each token is in its support
    assert torch.isin(block.tokens, drafter.draft_vocab).all()  # only the draft vocabulary is proposed
    assert torch.equal(block.support_probs[1, :, 0], torch.ones(GAMMA))  # greedy row: support of one


@pytest.mark.parametrize("kind, overrides", [("dspark", {}), ("eagle3", {}), ("dspark", {"markov_table": "compact"})])
def test_save_load_round_trip_gives_identical_drafts(target, sequence, kind, overrides, tmp_path):
    tokens, features = sequence
    drafter = make(target, kind, draft_vocab_size=24, version="v-test", **overrides)
    save_drafter(drafter, tmp_path / "fp32", dtype=torch.float32)
    loaded = load_drafter(tmp_path / "fp32", target.model.embed_tokens.weight, target.lm_head.weight)
    assert loaded.cfg == drafter.cfg and loaded.version == "v-test"
    for d in (drafter, loaded):
        d.extend_context("r", features[:14], tokens[:14])
    _assert_same_block(_draft_seeded(drafter, ["r"], tokens[14:15]), _draft_seeded(loaded, ["r"], tokens[14:15]))
    # bf16 (the shipped form) reproduces the bf16-rounded original
    save_drafter(drafter, tmp_path / "bf16")
    small = load_drafter(tmp_path / "bf16", target.model.embed_tokens.weight, target.lm_head.weight)
    with torch.no_grad():
        for p in drafter.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    drafter.release("r")
    for d in (drafter, small):
        d.extend_context("r", features[:14], tokens[:14])
    _assert_same_block(_draft_seeded(drafter, ["r"], tokens[14:15]), _draft_seeded(small, ["r"], tokens[14:15]))


def test_compact_token_table_is_a_draft_vocab_table_plus_a_projection(target):
    full = make(target, "dspark", draft_vocab_size=24)
    compact = make(target, "dspark", draft_vocab_size=24, markov_table="compact")
    table = compact.head.W1
    assert table.rows.weight.shape == (25, 16) and table.proj.weight.shape == (16, target.config.hidden_size)
    assert full.head.W1.weight.shape == (target.config.vocab_size, 16)
    inside, outside = compact.draft_vocab[:3], torch.tensor([1, 3, 5])  # the draft vocab is every other id
    with torch.no_grad():
        projected = table.proj(compact.embed(torch.cat([inside, outside])))
        got = compact.prev_embedding(torch.cat([inside, outside]))
    torch.testing.assert_close(got[:3], projected[:3] + table.rows.weight[:3])
    torch.testing.assert_close(got[3:], projected[3:] + table.rows.weight[24])  # one shared row for the rest


def test_load_refuses_a_different_target(target, tmp_path):
    drafter = make(target, "dflash")
    save_drafter(drafter, tmp_path / "d")
    with pytest.raises(ValueError):
        load_drafter(tmp_path / "d", torch.zeros(64, 16), torch.zeros(64, 16))


@pytest.mark.parametrize("kind,overrides", [("dspark", {}), ("dflash", {}), ("dspark", {"draft_vocab_size": 24}),
                                            ("dspark", {"draft_vocab_size": 24, "markov_table": "compact"})])
def test_greedy_fast_path_drafts_what_the_general_loop_drafts(target, sequence, kind, overrides):
    """An all-greedy batch takes the argmax loop with W1 of draft tokens from a table; the general
    loop (taken when logits are asked for) must give the same tokens, supports and confidences,
    also after the weights change in place (the table is rebuilt)."""
    tokens, features = sequence
    drafter = make(target, kind, **overrides)
    for r, n in (("a", 9), ("b", 17), ("c", 5)):
        drafter.extend_context(r, features[:n], tokens[:n])
    anchors = tokens[torch.tensor([9, 17, 5])]

    def both():
        fast = drafter.draft(["a", "b", "c"], anchors, torch.zeros(3), [None] * 3)
        general = drafter.draft(["a", "b", "c"], anchors, torch.zeros(3), [None] * 3, return_logits=True)
        assert torch.equal(fast.tokens, general.tokens)
        assert torch.equal(fast.support_ids, general.support_ids)
        assert torch.equal(fast.support_probs, general.support_probs)
        if general.conf_logits is not None:
            torch.testing.assert_close(fast.conf_logits, general.conf_logits)
        return fast.tokens

    before = both()
    if drafter.head is None:
        return
    with torch.no_grad():  # as an optimizer step does: in place
        for p in drafter.head.W1.parameters():
            p.mul_(-1.5)
    assert not torch.equal(both(), before)  # the new W1 drafts differently, and both paths agree


def test_the_bias_table_holds_the_markov_bias_after_each_draft_token(target):
    """On a CPU, slots after the first read W2 W1[x] from a table instead of a 1-row matmul: each row
    is that bias (to bf16), and it follows the weights."""
    drafter = make(target, "dspark", draft_vocab_size=24, markov_table="compact")
    assert make(target, "dflash")._draft_token_biases() is None
    with torch.no_grad():
        for p in drafter.head.parameters():
            p.normal_()
        table = drafter._draft_token_biases()
        want = drafter.head.W2(drafter.prev_embedding(drafter.draft_vocab))
        assert table.shape == (24, 24) and table.dtype == torch.bfloat16
        torch.testing.assert_close(table.float(), want, rtol=1e-2, atol=1e-2)
        drafter.head.W2.weight.mul_(2)
        torch.testing.assert_close(drafter._draft_token_biases().float(), 2 * want, rtol=1e-2, atol=2e-2)


@pytest.mark.parametrize("kind", ["dspark", "dflash"])
def test_serving_fusion_drafts_what_the_checkpoint_layout_drafts(target, sequence, kind):
    """apply_precision fuses q|k|v (block rows) and k|v (context rows) into one matmul each, which puts
    drafting on the CPU kernels where they exist (the block's keys in the context's cache): same
    context keys and values, same block logits as the separate projections training keeps."""
    import copy

    from dspark.models.precision import apply_precision

    tokens, features = sequence
    separate = make(target, kind)
    fused = copy.deepcopy(separate)
    apply_precision(fused, "fp32")
    assert all(hasattr(layer, "qkv_proj") and not hasattr(layer, "q_proj") for layer in fused.layers)
    assert fused._on_cpu_kernels() == (kernels() is not None) and not separate._on_cpu_kernels()
    for drafter in (separate, fused):
        drafter.extend_context("r", features[:13], tokens[:13])
        drafter.extend_context("s", features[:6], tokens[:6])  # a shorter context: padded rows in the batch
    (got_kv, got_valid), (want_kv, want_valid) = fused.contexts.gather(["r"]), separate.contexts.gather(["r"])
    torch.testing.assert_close(got_valid, want_valid, atol=1e-5, rtol=1e-5)
    for got, want in zip(got_kv, want_kv):  # each layer's context keys and values
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    anchors, temperatures = tokens[torch.tensor([13, 6])], torch.zeros(2)
    want = separate.draft(["r", "s"], anchors, temperatures, [None, None], return_logits=True)
    got = fused.draft(["r", "s"], anchors, temperatures, [None, None], return_logits=True)
    torch.testing.assert_close(got.logits, want.logits, atol=1e-4, rtol=1e-4)
    assert torch.equal(got.tokens, want.tokens)
    # A draft-ahead block (anchor two positions past the context), then a context that grew and was
    # rolled back under the block's scratch keys: the next draft reads only real context.
    anchors = tokens[torch.tensor([15, 6])]
    want = separate.draft(["r", "s"], anchors, temperatures, [None, None], return_logits=True, gaps=[2, 0])
    got = fused.draft(["r", "s"], anchors, temperatures, [None, None], return_logits=True, gaps=[2, 0])
    torch.testing.assert_close(got.logits, want.logits, atol=1e-4, rtol=1e-4)
    for drafter in (separate, fused):
        drafter.extend_context("r", features[13:20], tokens[13:20])
        drafter.rollback("r", 16)
    want = separate.draft(["r"], tokens[16:17], temperatures[:1], [None], return_logits=True)
    got = fused.draft(["r"], tokens[16:17], temperatures[:1], [None], return_logits=True)
    torch.testing.assert_close(got.logits, want.logits, atol=1e-4, rtol=1e-4)


def test_context_kv_keeps_every_request_through_growth_rollback_and_release():
    """Slots and capacity double as requests and contexts grow (copies of what is there); a released
    slot is reused; each request reads back exactly its own rows."""
    store, rows = ContextKV(num_layers=2, kv_heads=2, head_dim=4), {}
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        for i in range(6):  # six requests: past the first 4 slots; 3 x 30 rows: past capacity 64
            req = f"r{i}"
            kv = [(torch.randn(30, 2, 4, generator=g), torch.randn(30, 2, 4, generator=g)) for _ in range(2)]
            store.append(req, kv)
            rows.setdefault(req, []).append(kv)
    store.truncate("r2", 40)
    store.release("r5")
    store.append("new", [(torch.ones(3, 2, 4), torch.zeros(3, 2, 4))] * 2)
    assert store.slots == 8 and store.capacity >= 90 and len(store) == 6 and "r5" not in store
    layers, valid = store.gather(["r0", "r2", "new"])
    for layer, (k, v) in enumerate(layers):
        assert k.shape == (3, 2, 90, 4) and valid.sum(1).tolist() == [90, 40, 3]
        for i, req in enumerate(["r0", "r2"]):
            want_k = torch.cat([kv[layer][0] for kv in rows[req]]).transpose(0, 1)
            want_v = torch.cat([kv[layer][1] for kv in rows[req]]).transpose(0, 1)
            n = int(valid[i].sum())
            assert torch.equal(k[i, :, :n], want_k[:, :n]) and torch.equal(v[i, :, :n], want_v[:, :n])
        assert torch.equal(k[2, :, :3], torch.ones(2, 3, 4))
