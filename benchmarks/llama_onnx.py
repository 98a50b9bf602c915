"""A Llama-shaped decoder with a KV cache, built with onnx.helper from seeded NumPy random weights
(no torch): RMSNorm, rotary embeddings from position_ids, grouped-query attention over the past
concatenated with the new keys and values, a causal plus padding mask from attention_mask (left
padding works: masked positions get a large negative bias), a SwiGLU MLP, a final norm and an
untied LM head. Inputs and outputs are named as the project's fixtures (and torch/optimum's
exports) name them:

    input_ids [batch, seq] int64, attention_mask [batch, total] int64, position_ids [batch, seq] int64,
    past_key_values.{i}.key/value [batch, kv_heads, past, head_dim] float32
    -> logits [batch, seq, vocab], present.{i}.key/value [batch, kv_heads, total, head_dim]

`reference_forward` is the same math in NumPy; `python -m benchmarks.llama_onnx --check` (and
tests/test_llama_onnx_builder.py) compares the two and checks onnxruntime's greedy tokens with
and without the cache.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

MASKED = -1.0e9  # the bias of a masked key: large, finite (a fully masked row stays finite)


@dataclass(frozen=True)
class LlamaConfig:
    vocab: int = 32000
    hidden: int = 512
    heads: int = 8
    kv_heads: int = 4
    head_dim: int = 64
    intermediate: int = 1408
    layers: int = 2
    context: int = 2048
    rope_theta: float = 10000.0
    eps: float = 1e-6
    seed: int = 0

    def parameters(self) -> int:
        per_layer = (
            self.hidden * self.heads * self.head_dim * 2
            + self.hidden * self.kv_heads * self.head_dim * 2
            + 3 * self.hidden * self.intermediate
            + 2 * self.hidden
        )
        return 2 * self.vocab * self.hidden + self.layers * per_layer + self.hidden


SMALL = LlamaConfig(
    vocab=256, hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=96, layers=2, context=128
)


def random_weights(config: LlamaConfig) -> dict[str, np.ndarray]:
    """Seeded float32 weights; projections scaled by 1/sqrt(fan_in) so logits are spread (greedy
    ties between near-equal logits would make a cache/no-cache comparison flaky)."""
    rng = np.random.default_rng(config.seed)

    def dense(fan_in: int, fan_out: int) -> np.ndarray:
        return (rng.standard_normal((fan_in, fan_out)) / np.sqrt(fan_in)).astype(np.float32)

    c = config
    weights = {"embed": rng.standard_normal((c.vocab, c.hidden)).astype(np.float32)}
    for i in range(c.layers):
        weights[f"l{i}.attn_norm"] = (1.0 + 0.1 * rng.standard_normal(c.hidden)).astype(np.float32)
        weights[f"l{i}.wq"] = dense(c.hidden, c.heads * c.head_dim)
        weights[f"l{i}.wk"] = dense(c.hidden, c.kv_heads * c.head_dim)
        weights[f"l{i}.wv"] = dense(c.hidden, c.kv_heads * c.head_dim)
        weights[f"l{i}.wo"] = dense(c.heads * c.head_dim, c.hidden)
        weights[f"l{i}.mlp_norm"] = (1.0 + 0.1 * rng.standard_normal(c.hidden)).astype(np.float32)
        weights[f"l{i}.wg"] = dense(c.hidden, c.intermediate)
        weights[f"l{i}.wu"] = dense(c.hidden, c.intermediate)
        weights[f"l{i}.wd"] = dense(c.intermediate, c.hidden)
    weights["final_norm"] = (1.0 + 0.1 * rng.standard_normal(c.hidden)).astype(np.float32)
    weights["lm_head"] = dense(c.hidden, c.vocab)
    return weights


def _inv_freq(config: LlamaConfig) -> np.ndarray:
    half = np.arange(0, config.head_dim, 2, dtype=np.float64) / config.head_dim
    return (1.0 / config.rope_theta**half).astype(np.float32)


# ---------------------------------------------------------------- the graph


def build_model(config: LlamaConfig = LlamaConfig()):
    """The decoder as an onnx.ModelProto (opset 17)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    c = config
    weights = random_weights(c)
    nodes: list = []
    inits = [numpy_helper.from_array(array, name) for name, array in weights.items()]
    counter = [0]

    def const(name: str, value) -> str:
        inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def node(op: str, inputs: list[str], **attrs) -> str:
        counter[0] += 1
        out = f"{op.lower()}_{counter[0]}"
        nodes.append(helper.make_node(op, inputs, [out], name=f"n{counter[0]}_{op}", **attrs))
        return out

    def named(op: str, inputs: list[str], output: str, **attrs) -> str:
        counter[0] += 1
        nodes.append(helper.make_node(op, inputs, [output], name=f"n{counter[0]}_{op}", **attrs))
        return output

    const("two", np.array(2.0, np.float32))
    const("eps", np.array(c.eps, np.float32))
    const("one_i", np.array([1], np.int64))
    const("zero_s", np.array(0, np.int64))
    const("one_s", np.array(1, np.int64))
    const("masked", np.array(MASKED, np.float32))
    const("zero_f", np.array(0.0, np.float32))
    const("inv_freq", _inv_freq(c))
    const("scale", np.array(1.0 / np.sqrt(c.head_dim), np.float32))
    const("q_shape", np.array([0, 0, c.heads, c.head_dim], np.int64))
    const("kv_shape", np.array([0, 0, c.kv_heads, c.head_dim], np.int64))
    const("rep_shape", np.array([0, c.heads, -1, c.head_dim], np.int64))
    const("merge_shape", np.array([0, 0, c.heads * c.head_dim], np.int64))
    const("half_start", np.array([c.head_dim // 2], np.int64))
    const("half_end", np.array([c.head_dim], np.int64))
    const("zero_start", np.array([0], np.int64))
    const("last_axis", np.array([-1], np.int64))
    const("two_axis", np.array([2], np.int64))
    const("one_f", np.array(1.0, np.float32))

    def rms_norm(x: str, weight: str) -> str:
        mean = node("ReduceMean", [node("Pow", [x, "two"])], axes=[-1], keepdims=1)
        rstd = node("Div", ["one_f", node("Sqrt", [node("Add", [mean, "eps"])])])
        return node("Mul", [node("Mul", [x, rstd]), weight])

    # rotary tables from position_ids: [batch, 1, seq, head_dim]
    positions = node("Cast", ["position_ids"], to=TensorProto.FLOAT)
    freqs = node("Mul", [node("Unsqueeze", [positions, "last_axis"]), "inv_freq"])
    angles = node("Unsqueeze", [node("Concat", [freqs, freqs], axis=-1), "one_i"])
    cos, sin = node("Cos", [angles]), node("Sin", [angles])

    def rotate(x: str) -> str:  # x * cos + rotate_half(x) * sin, on [batch, heads, seq, head_dim]
        first = node("Slice", [x, "zero_start", "half_start", "last_axis"])
        second = node("Slice", [x, "half_start", "half_end", "last_axis"])
        rotated = node("Concat", [node("Neg", [second]), first], axis=-1)
        return node("Add", [node("Mul", [x, cos]), node("Mul", [rotated, sin])])

    # mask bias [batch, 1, seq, total]: key j is seen by query i when j <= past + i and the mask says 1
    ids_shape = node("Shape", ["input_ids"])
    mask_shape = node("Shape", ["attention_mask"])
    seq = node("Gather", [ids_shape, "one_s"], axis=0)
    total = node("Gather", [mask_shape, "one_s"], axis=0)
    past = node("Sub", [total, seq])
    key_index = node("Range", ["zero_s", total, "one_s"])
    query_index = node("Range", [past, total, "one_s"])
    causal = node(
        "LessOrEqual",
        [node("Unsqueeze", [key_index, "zero_start"]), node("Unsqueeze", [query_index, "one_i"])],
    )
    const("pad_axes", np.array([1, 2], np.int64))
    padded = node("Equal", [node("Unsqueeze", ["attention_mask", "pad_axes"]), "one_s"])
    allowed = node("And", [causal, padded])
    bias = node("Where", [allowed, "zero_f", "masked"])

    h = node("Gather", ["embed", "input_ids"], axis=0)
    for i in range(c.layers):
        x = rms_norm(h, f"l{i}.attn_norm")
        q = node(
            "Transpose", [node("Reshape", [node("MatMul", [x, f"l{i}.wq"]), "q_shape"])], perm=[0, 2, 1, 3]
        )
        k = node(
            "Transpose", [node("Reshape", [node("MatMul", [x, f"l{i}.wk"]), "kv_shape"])], perm=[0, 2, 1, 3]
        )
        v = node(
            "Transpose", [node("Reshape", [node("MatMul", [x, f"l{i}.wv"]), "kv_shape"])], perm=[0, 2, 1, 3]
        )
        q, k = rotate(q), rotate(k)
        keys = named("Concat", [f"past_key_values.{i}.key", k], f"present.{i}.key", axis=2)
        values = named("Concat", [f"past_key_values.{i}.value", v], f"present.{i}.value", axis=2)

        def repeat(t: str, group: int = c.heads // c.kv_heads) -> str:
            # [b, kv, T, d] -> [b, heads, T, d]: kv head j serves heads j*group .. (j+1)*group-1
            if group == 1:
                return t
            wide = node("Unsqueeze", [t, "two_axis"])
            return node("Reshape", [node("Concat", [wide] * group, axis=2), "rep_shape"])

        scores = node(
            "Mul", [node("MatMul", [q, node("Transpose", [repeat(keys)], perm=[0, 1, 3, 2])]), "scale"]
        )
        probs = node("Softmax", [node("Add", [scores, bias])], axis=-1)
        attended = node(
            "Reshape",
            [node("Transpose", [node("MatMul", [probs, repeat(values)])], perm=[0, 2, 1, 3]), "merge_shape"],
        )
        h = node("Add", [h, node("MatMul", [attended, f"l{i}.wo"])])
        x = rms_norm(h, f"l{i}.mlp_norm")
        gate = node("MatMul", [x, f"l{i}.wg"])
        up = node("MatMul", [x, f"l{i}.wu"])
        swiglu = node("Mul", [node("Mul", [gate, node("Sigmoid", [gate])]), up])
        h = node("Add", [h, node("MatMul", [swiglu, f"l{i}.wd"])])
    named("MatMul", [rms_norm(h, "final_norm"), "lm_head"], "logits")

    batch, seq_d, past_d, total_d = (
        "batch_size",
        "sequence_length",
        "past_sequence_length",
        "total_sequence_length",
    )
    inputs = [
        helper.make_tensor_value_info("input_ids", TensorProto.INT64, [batch, seq_d]),
        helper.make_tensor_value_info("attention_mask", TensorProto.INT64, [batch, total_d]),
        helper.make_tensor_value_info("position_ids", TensorProto.INT64, [batch, seq_d]),
    ]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [batch, seq_d, c.vocab])]
    for i in range(c.layers):
        for part in ("key", "value"):
            inputs.append(
                helper.make_tensor_value_info(
                    f"past_key_values.{i}.{part}", TensorProto.FLOAT, [batch, c.kv_heads, past_d, c.head_dim]
                )
            )
            outputs.append(
                helper.make_tensor_value_info(
                    f"present.{i}.{part}", TensorProto.FLOAT, [batch, c.kv_heads, total_d, c.head_dim]
                )
            )
    graph = helper.make_graph(nodes, "llama", inputs, outputs, inits)
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="benchmarks.llama_onnx"
    )
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def model_bytes(config: LlamaConfig = LlamaConfig()) -> bytes:
    return build_model(config).SerializeToString()


# ---------------------------------------------------------------- the NumPy reference


def reference_forward(
    config: LlamaConfig,
    weights: dict[str, np.ndarray],
    input_ids: np.ndarray,
    attention_mask: np.ndarray,
    position_ids: np.ndarray,
    past: list[tuple[np.ndarray, np.ndarray]],
) -> tuple[np.ndarray, list[tuple[np.ndarray, np.ndarray]]]:
    """The same math as the graph: (logits, [(present key, present value)] per layer)."""
    c = config
    b, s = input_ids.shape
    total = attention_mask.shape[1]
    past_len = total - s

    def norm(x, w):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + c.eps) * w

    freqs = position_ids.astype(np.float32)[..., None] * _inv_freq(c)
    angles = np.concatenate([freqs, freqs], axis=-1)[:, None]
    cos, sin = np.cos(angles), np.sin(angles)

    def rotate(x):
        half = c.head_dim // 2
        return x * cos + np.concatenate([-x[..., half:], x[..., :half]], axis=-1) * sin

    causal = np.arange(total)[None, :] <= (past_len + np.arange(s))[:, None]
    allowed = causal[None, None] & (attention_mask[:, None, None, :] == 1)
    bias = np.where(allowed, 0.0, MASKED).astype(np.float32)
    h = weights["embed"][input_ids]
    presents = []
    group = c.heads // c.kv_heads
    for i in range(c.layers):
        x = norm(h, weights[f"l{i}.attn_norm"])
        q = (x @ weights[f"l{i}.wq"]).reshape(b, s, c.heads, c.head_dim).transpose(0, 2, 1, 3)
        k = (x @ weights[f"l{i}.wk"]).reshape(b, s, c.kv_heads, c.head_dim).transpose(0, 2, 1, 3)
        v = (x @ weights[f"l{i}.wv"]).reshape(b, s, c.kv_heads, c.head_dim).transpose(0, 2, 1, 3)
        q, k = rotate(q), rotate(k)
        keys = np.concatenate([past[i][0], k], axis=2)
        values = np.concatenate([past[i][1], v], axis=2)
        presents.append((keys, values))
        keys_r, values_r = np.repeat(keys, group, axis=1), np.repeat(values, group, axis=1)
        scores = q @ keys_r.transpose(0, 1, 3, 2) * np.float32(1.0 / np.sqrt(c.head_dim)) + bias
        scores = scores - scores.max(axis=-1, keepdims=True)
        probs = np.exp(scores)
        probs /= probs.sum(axis=-1, keepdims=True)
        attended = (probs @ values_r).transpose(0, 2, 1, 3).reshape(b, s, c.heads * c.head_dim)
        h = h + attended @ weights[f"l{i}.wo"]
        x = norm(h, weights[f"l{i}.mlp_norm"])
        gate = x @ weights[f"l{i}.wg"]
        h = h + (gate / (1 + np.exp(-gate)) * (x @ weights[f"l{i}.wu"])) @ weights[f"l{i}.wd"]
    return norm(h, weights["final_norm"]) @ weights["lm_head"], presents


def empty_past(config: LlamaConfig, batch: int, length: int = 0) -> dict[str, np.ndarray]:
    shape = (batch, config.kv_heads, length, config.head_dim)
    return {
        f"past_key_values.{i}.{part}": np.zeros(shape, np.float32)
        for i in range(config.layers)
        for part in ("key", "value")
    }


def greedy_ort(session, config: LlamaConfig, prompt: list[int], steps: int, cache: bool = True) -> list[int]:
    """Greedy tokens from an onnxruntime session: with the KV cache (one token a step after the
    prompt) or without it (the whole sequence every step, an empty past)."""
    tokens = list(prompt)
    past = empty_past(config, 1)
    generated: list[int] = []
    fed = 0
    for _ in range(steps):
        if cache:
            new = tokens[fed:]
            total = fed + len(new)
            feeds = {
                "input_ids": np.array([new], np.int64),
                "attention_mask": np.ones((1, total), np.int64),
                "position_ids": np.arange(fed, total, dtype=np.int64)[None],
                **past,
            }
        else:
            feeds = {
                "input_ids": np.array([tokens], np.int64),
                "attention_mask": np.ones((1, len(tokens)), np.int64),
                "position_ids": np.arange(len(tokens), dtype=np.int64)[None],
                **empty_past(config, 1),
            }
        outputs = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds), strict=True))
        if cache:
            fed = total
            past = {
                f"past_key_values.{i}.{part}": outputs[f"present.{i}.{part}"]
                for i in range(config.layers)
                for part in ("key", "value")
            }
        token = int(np.argmax(outputs["logits"][0, -1]))
        generated.append(token)
        tokens.append(token)
    return generated


def check(config: LlamaConfig, steps: int = 12, verbose: bool = True) -> dict[str, float]:
    """Compares onnxruntime with the NumPy reference (a left-padded batch of two, a cached step)
    and greedy tokens with and without the cache; raises AssertionError on a mismatch."""
    import onnxruntime as ort

    model = build_model(config)
    weights = random_weights(config)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    rng = np.random.default_rng(1)
    # a batch of two: the second left-padded by 3
    ids = rng.integers(0, config.vocab, size=(2, 7))
    mask = np.ones((2, 7), np.int64)
    mask[1, :3] = 0
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    feeds = {"input_ids": ids, "attention_mask": mask, "position_ids": positions, **empty_past(config, 2)}
    got = dict(zip(names, session.run(None, feeds), strict=True))
    want, presents = reference_forward(
        config,
        weights,
        ids,
        mask,
        positions,
        [(np.zeros((2, config.kv_heads, 0, config.head_dim), np.float32),) * 2 for _ in range(config.layers)],
    )
    # rows of padding (every key masked) are meaningless either side: compared where the mask is 1
    prefill_error = float(np.max(np.abs(got["logits"] - want)[mask == 1]))
    # one cached step on top
    step_ids = rng.integers(0, config.vocab, size=(2, 1))
    step_mask = np.concatenate([mask, np.ones((2, 1), np.int64)], axis=1)
    step_positions = positions[:, -1:] + 1
    step_feeds = {"input_ids": step_ids, "attention_mask": step_mask, "position_ids": step_positions}
    for i in range(config.layers):
        step_feeds[f"past_key_values.{i}.key"] = got[f"present.{i}.key"]
        step_feeds[f"past_key_values.{i}.value"] = got[f"present.{i}.value"]
    got_step = dict(zip(names, session.run(None, step_feeds), strict=True))
    want_step, _ = reference_forward(config, weights, step_ids, step_mask, step_positions, presents)
    step_error = float(np.max(np.abs(got_step["logits"] - want_step)))
    # the padded row equals the same prompt unpadded
    alone = {
        "input_ids": ids[1:, 3:],
        "attention_mask": np.ones((1, 4), np.int64),
        "position_ids": np.arange(4)[None],
        **empty_past(config, 1),
    }
    pad_error = float(np.max(np.abs(session.run(["logits"], alone)[0][0] - got["logits"][1, 3:])))
    scale = float(np.max(np.abs(want)))
    prompt = [int(t) for t in rng.integers(0, config.vocab, size=5)]
    cached, uncached = (
        greedy_ort(session, config, prompt, steps),
        greedy_ort(session, config, prompt, steps, cache=False),
    )
    report = {
        "prefill_error": prefill_error,
        "step_error": step_error,
        "padding_error": pad_error,
        "logit_scale": scale,
    }
    if verbose:
        print(json.dumps({**report, "greedy_cached": cached, "greedy_uncached": uncached}))
    tolerance = 1e-3 * max(1.0, scale)
    assert prefill_error < tolerance and step_error < tolerance and pad_error < tolerance, report
    assert cached == uncached, (cached, uncached)
    return report


# ---------------------------------------------------------------- a bundle around it


def word_tokenizer_files(config: LlamaConfig, eos: bool = False) -> dict[str, bytes]:
    """A word-level tokenizer with one word per model token ("w0".."w{vocab-1}"), so every token
    the random model picks decodes to text of its own; config.json gives the context length."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(config.vocab)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    files = {
        "tokenizer.json": tokenizer.to_str().encode(),
        "tokenizer_config.json": json.dumps({"model_max_length": config.context}).encode(),
        "generation_config.json": json.dumps({"eos_token_id": 0} if eos else {}).encode(),
        "config.json": json.dumps(
            {
                "model_type": "llama",
                "vocab_size": config.vocab,
                "hidden_size": config.hidden,
                "num_attention_heads": config.heads,
                "num_key_value_heads": config.kv_heads,
                "head_dim": config.head_dim,
                "intermediate_size": config.intermediate,
                "num_hidden_layers": config.layers,
                "max_position_embeddings": config.context,
                "rms_norm_eps": config.eps,
                "rope_theta": config.rope_theta,
                "tie_word_embeddings": False,
            }
        ).encode(),
    }
    return files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="check against NumPy and onnxruntime")
    parser.add_argument("--small", action="store_true", help="the small config (tests' size)")
    parser.add_argument("--out", type=Path, help="write model.onnx (and the tokenizer files) here")
    args = parser.parse_args(argv)
    config = SMALL if args.small else LlamaConfig()
    if args.check:
        check(config)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "model.onnx").write_bytes(model_bytes(config))
        for name, data in word_tokenizer_files(config).items():
            (args.out / name).write_bytes(data)
        print(json.dumps({"written": str(args.out), "config": asdict(config)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
