"""Random-weight Llama models in the shapes of real ones, written as sharded Hugging Face directories.

For measurements that need a model's shapes but not its knowledge (memory, time, kernels, parity), where the real
weights are too large to copy or not at hand. The weights are drawn tensor by tensor straight into the storage
dtype and written shard by shard, so building holds about one shard in memory. ``--device cuda`` draws them on the
GPU (one CPU thread needs minutes for 6.7B values; the GPU draws them at once and writing the shards is what is left).
``--layers N`` keeps the preset's width with N decoder layers (to time per-layer work at a large width). A directory
that already holds the same build (same preset, layers, dtype, seed, device, shard size and tokenizer, recorded in
``random_model.json``) is reused.

Presets (``PRESETS``): ``llama3.2-1b`` (hidden 2048, 16 layers, 32/8 heads, intermediate 8192, vocab 128256, tied
embeddings, rope theta 500000), ``smollm2-135m`` (576, 30 layers, 9/3 heads, 1536, vocab 49152, tied),
``llama2-7b`` (4096, 32 layers, 32/32 heads, 11008, vocab 32000, untied) and ``tiny`` (for checking scripts).

Mixture-of-experts presets are ``qwen3_moe`` directories whose tensors are stored per expert
(``model.layers.N.mlp.experts.E.gate_proj.weight``, as transformers' ``save_pretrained`` writes them and quantkit
reads them), with the router ``mlp.gate`` and q/k norms. ``qwen3-30b-a3b-e16`` has Qwen3-30B-A3B's per-layer
shapes (hidden 2048, 32/4 heads of head_dim 128, expert intermediate 768, top-8 routing with norm_topk_prob, rms
eps 1e-6, rope theta 1e6, full vocab 151936, untied head) with 16 experts per layer instead of 128 and 12 layers
instead of 48 (the real model's 30.53B parameters come out of these shapes at 128 x 48): 1.76B parameters, 3510 MB
in bf16. Why 16 experts: quantkit holds one block in float32 (a 128-expert layer is 623M parameters, 2.5 GB) and
its GPTQ solves a stage's linears of one scheme as one row-stacked matrix, all experts' gate/up together, so one
MoE block peaked at 2.3 GB (anonymous) with 32 experts and 1.5 GB with 16: only 16 leaves a cap of 60% of a 1-2B
model's bf16 size (2106 MB here) room to spare. Top-8 of 16 keeps the real model's routed work per token.
``tiny-moe`` is the same layout at toy size, head_dim unequal to hidden / heads as in the real model.

Tokenizer: ``--tokenizer DIR`` copies a tokenizer's files (its vocabulary must fit the model's); without it a
word-level tokenizer of exactly the model's vocabulary size is built from the shipped Persuasion text (most words
of the text, then placeholder tokens), so nothing outside the repository is needed.

    python -m tools.random_model llama2-7b /tmp/llama7b --dtype float16 --device cuda
    python -m tools.random_model llama2-7b /tmp/llama7b-8 --dtype float16 --device cuda --layers 8
    python -m tools.random_model llama3.2-1b /work/tmp/scale/model --tokenizer ~/.cache/quantkit/models/smollm2-135m
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import shutil
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
TEXT = REPO / "calibration" / "austen_persuasion_eval.txt"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
SPECIALS = ("<unk>", "<s>", "</s>")  # ids 0, 1, 2 of a built tokenizer: unknown, bos, eos (also padding)
BUILD_RECORD = ".random_model.json"  # hidden: a checkpoint made from the model does not copy it
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(frozen=True)
class Experts:
    """A sparse MLP (Qwen3-MoE): ``count`` experts of ``intermediate`` columns, each token routed to ``top_k``."""

    count: int
    top_k: int
    intermediate: int
    norm_topk_prob: bool = True  # renormalise the top-k routing weights to sum to one (Qwen3-30B-A3B does)


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int  # a dense MLP's; an MoE config records it but no tensor has it (every layer is sparse)
    vocab: int
    tied: bool
    rope_theta: float
    max_positions: int = 4096
    head_dim: int | None = None  # None: hidden // heads (Qwen3-MoE's 128 is not 2048 // 32)
    experts: Experts | None = None  # None: a dense Llama; else a qwen3_moe model (q/k norms, per-expert tensors)

    @property
    def model_type(self) -> str:
        return "llama" if self.experts is None else "qwen3_moe"

    @property
    def attention_dim(self) -> int:
        """One head's width."""
        return self.head_dim or self.hidden // self.heads


QWEN3_30B_A3B_EXPERTS = Experts(count=16, top_k=8, intermediate=768)  # 128 experts in the real model: see above
PRESETS = {
    "llama3.2-1b": Shape(2048, 16, 32, 8, 8192, 128256, tied=True, rope_theta=500000.0),
    "smollm2-135m": Shape(576, 30, 9, 3, 1536, 49152, tied=True, rope_theta=100000.0),
    "llama2-7b": Shape(4096, 32, 32, 32, 11008, 32000, tied=False, rope_theta=10000.0),
    "tiny": Shape(128, 2, 4, 2, 256, 512, tied=True, rope_theta=10000.0, max_positions=1024),
    "qwen3-30b-a3b-e16": Shape(
        2048, 12, 32, 4, 6144, 151936, False, 1e6, max_positions=40960, head_dim=128, experts=QWEN3_30B_A3B_EXPERTS
    ),
    "tiny-moe": Shape(128, 2, 4, 2, 256, 512, False, 1e6, max_positions=1024, head_dim=64, experts=Experts(8, 2, 64)),
}


@dataclass(frozen=True)
class Build:
    """Everything a build depends on (recorded beside it, so an equal request reuses it)."""

    preset: str
    shape: Shape
    dtype: str
    seed: int
    shard_mb: int
    init_std: float  # every matrix ~ N(0, init_std); norms are ones
    tokenizer: str  # the copied tokenizer's directory, or "built"
    device: str = "cpu"  # where the weights were drawn (a CUDA generator draws other values than the CPU one)


def tensor_shapes(shape: Shape) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor of the model in checkpoint order (HF Llama / Qwen3-MoE names)."""
    h, head_dim = shape.hidden, shape.attention_dim
    q, kv = shape.heads * head_dim, shape.kv_heads * head_dim
    names: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (shape.vocab, h))]
    for i in range(shape.layers):
        p = f"model.layers.{i}"
        names += [
            (f"{p}.input_layernorm.weight", (h,)),
            (f"{p}.self_attn.q_proj.weight", (q, h)),
            (f"{p}.self_attn.k_proj.weight", (kv, h)),
            (f"{p}.self_attn.v_proj.weight", (kv, h)),
            (f"{p}.self_attn.o_proj.weight", (h, q)),
            (f"{p}.post_attention_layernorm.weight", (h,)),
        ]
        if shape.experts is None:
            names += [
                (f"{p}.mlp.gate_proj.weight", (shape.intermediate, h)),
                (f"{p}.mlp.up_proj.weight", (shape.intermediate, h)),
                (f"{p}.mlp.down_proj.weight", (h, shape.intermediate)),
            ]
            continue
        names += [(f"{p}.self_attn.q_norm.weight", (head_dim,)), (f"{p}.self_attn.k_norm.weight", (head_dim,))]
        names.append((f"{p}.mlp.gate.weight", (shape.experts.count, h)))  # the router: a matrix, drawn like one
        inner = shape.experts.intermediate
        for e in range(shape.experts.count):
            names += [
                (f"{p}.mlp.experts.{e}.gate_proj.weight", (inner, h)),
                (f"{p}.mlp.experts.{e}.up_proj.weight", (inner, h)),
                (f"{p}.mlp.experts.{e}.down_proj.weight", (h, inner)),
            ]
    names.append(("model.norm.weight", (h,)))
    if not shape.tied:
        names.append(("lm_head.weight", (shape.vocab, h)))
    return names


def parameter_count(shape: Shape) -> int:
    return sum(torch.Size(s).numel() for _, s in tensor_shapes(shape))


def _random_tensor(size: tuple[int, ...], dtype: torch.dtype, std: float, gen: torch.Generator) -> torch.Tensor:
    """On the CPU, drawn on the generator's device."""
    if len(size) == 1:
        return torch.ones(size, dtype=dtype)  # RMSNorm weights
    return torch.empty(size, dtype=dtype, device=gen.device).normal_(0.0, std, generator=gen).cpu()


def write_weights(out: Path, build: Build) -> int:
    """The safetensors shards (one file, or several and their index); returns the bytes of tensor data."""
    from safetensors.torch import save_file

    dtype, limit = DTYPES[build.dtype], build.shard_mb * 1_000_000
    gen = torch.Generator(device=build.device).manual_seed(build.seed)
    shards: list[list[str]] = []
    pending: dict[str, torch.Tensor] = {}
    pending_bytes = total = 0

    def flush() -> None:
        nonlocal pending, pending_bytes
        save_file(pending, str(out / f"shard-{len(shards):05d}.tmp"), metadata={"format": "pt"})
        shards.append(list(pending))
        pending, pending_bytes = {}, 0

    for name, size in tensor_shapes(build.shape):
        tensor = _random_tensor(size, dtype, build.init_std, gen)
        nbytes = tensor.numel() * tensor.element_size()
        if pending and pending_bytes + nbytes > limit:
            flush()
        pending[name] = tensor
        pending_bytes += nbytes
        total += nbytes
    flush()
    _name_shards(out, shards, total)
    return total


def _name_shards(out: Path, shards: list[list[str]], total: int) -> None:
    if len(shards) == 1:
        (out / "shard-00000.tmp").rename(out / "model.safetensors")
        return
    weight_map = {}
    for i, names in enumerate(shards):
        final = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        (out / f"shard-{i:05d}.tmp").rename(out / final)
        weight_map.update(dict.fromkeys(names, final))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def write_config(out: Path, build: Build) -> None:
    from transformers import LlamaConfig, Qwen3MoeConfig

    s = build.shape
    common = {
        "hidden_size": s.hidden,
        "num_hidden_layers": s.layers,
        "num_attention_heads": s.heads,
        "num_key_value_heads": s.kv_heads,
        "intermediate_size": s.intermediate,
        "vocab_size": s.vocab,
        "tie_word_embeddings": s.tied,
        "rope_theta": s.rope_theta,
        "max_position_embeddings": s.max_positions,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 2,
        "dtype": build.dtype,
    }
    if s.experts is None:
        LlamaConfig(**common, rms_norm_eps=1e-5).save_pretrained(out)
        return
    Qwen3MoeConfig(
        **common,
        rms_norm_eps=1e-6,
        head_dim=s.attention_dim,
        num_experts=s.experts.count,
        num_experts_per_tok=s.experts.top_k,
        moe_intermediate_size=s.experts.intermediate,
        norm_topk_prob=s.experts.norm_topk_prob,
        decoder_sparse_step=1,  # every layer sparse (quantkit supports no mix of dense and sparse layers)
        mlp_only_layers=[],
    ).save_pretrained(out)


def write_tokenizer(out: Path, vocab_size: int, source: Path | None) -> None:
    """Copy ``source``'s tokenizer files, or build a word-level tokenizer of ``vocab_size`` tokens."""
    if source is not None:
        copied = [f for f in TOKENIZER_FILES if (source / f).is_file()]
        if "tokenizer.json" not in copied:
            raise SystemExit(f"{source} has no tokenizer.json")
        for name in copied:
            shutil.copy2(source / name, out / name)
        size = len(json.loads((source / "tokenizer.json").read_text())["model"]["vocab"])
        if size > vocab_size:
            raise SystemExit(f"the tokenizer of {source} has {size} tokens, more than the model's {vocab_size}")
        return
    _word_tokenizer(vocab_size).save_pretrained(out)


def _word_tokenizer(vocab_size: int):
    """Specials, the most frequent words and punctuation of the shipped text, then placeholders up to the size."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    counts = collections.Counter(re.findall(r"\w+|[^\w\s]", TEXT.read_text()))
    words = [w for w, _ in counts.most_common(max(0, vocab_size - len(SPECIALS)))]
    vocab_list = [*SPECIALS, *words]
    vocab_list += [f"<extra_{i}>" for i in range(vocab_size - len(vocab_list))]
    core = Tokenizer(models.WordLevel(vocab={t: i for i, t in enumerate(vocab_list)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=core, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="</s>"
    )


def build_random_model(
    out: Path,
    preset: str,
    *,
    dtype: str = "bfloat16",
    seed: int = 0,
    shard_mb: int = 1000,
    init_std: float = 0.02,
    tokenizer: Path | None = None,
    device: str = "cpu",
    layers: int | None = None,
) -> Path:
    """The model directory ``out`` (built unless it already holds this very build); ``layers`` replaces the preset's
    depth."""
    shape = PRESETS[preset] if layers is None else replace(PRESETS[preset], layers=layers)
    build = Build(preset, shape, dtype, seed, shard_mb, init_std, str(tokenizer) if tokenizer else "built", device)
    record = json.loads(json.dumps(asdict(build)))
    if (out / BUILD_RECORD).is_file() and json.loads((out / BUILD_RECORD).read_text()) == record:
        return out
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    write_weights(out, build)
    write_config(out, build)
    write_tokenizer(out, build.shape.vocab, tokenizer)
    (out / BUILD_RECORD).write_text(json.dumps(record, indent=1) + "\n")  # last: marks the build complete
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("preset", choices=sorted(PRESETS))
    parser.add_argument("out", type=Path)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shard-mb", type=int, default=1000, help="largest shard, MB (10^6 bytes)")
    parser.add_argument("--init-std", type=float, default=0.02, help="standard deviation of every matrix")
    parser.add_argument("--tokenizer", type=Path, help="copy this directory's tokenizer (default: build one)")
    parser.add_argument("--device", default="cpu", help="draw the weights here (cpu, cuda, cuda:N)")
    parser.add_argument("--layers", type=int, help="decoder layers (default: the preset's)")
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device}: torch sees no CUDA device here; use --device cpu")
    if args.layers is not None and args.layers < 1:
        raise SystemExit(f"--layers {args.layers}: give at least 1")
    options = vars(args)  # the options are build_random_model's keyword arguments
    preset = options.pop("preset")
    out = build_random_model(options.pop("out"), preset, **options)
    shape = PRESETS[preset] if args.layers is None else replace(PRESETS[preset], layers=args.layers)
    params = parameter_count(shape)
    print(f"{out}: {preset} ({shape.model_type}), {params / 1e6:.0f}M parameters, {args.dtype}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
