"""Helpers shared by the benchmarks in bench/: cache resets, formatting, subprocess workers, JSON output.

Import as ``from bench.common import ...`` (each script puts the repository root on ``sys.path`` first)
or, from a script run directly, ``from common import ...``.
"""

from __future__ import annotations

import gc
import json
import os
import platform
import subprocess
import sys
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
OUT_DIR = os.path.join(HERE, "out")
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402


def reset_all() -> None:
    """``stampout.reset()`` (reported, not raised, if it fails), ``torch._dynamo.reset()``, a GC pass."""
    try:
        import stampout

        if hasattr(stampout, "reset"):
            stampout.reset()
    except Exception as e:  # noqa: BLE001 - the library is a work in progress; a broken reset is reported
        print(f"stampout.reset() failed: {type(e).__name__}: {e}", file=sys.stderr)
    torch._dynamo.reset()
    gc.collect()


def fmt_ms(t: float | None) -> str:
    """Seconds as milliseconds with one decimal; ``-`` for None."""
    return "-" if t is None else f"{t * 1e3:.1f}"


def fmt_ratio(num: float | None, den: float | None) -> str:
    """``num / den`` as ``1.23x``; ``-`` when either is missing or ``den`` is 0."""
    return "-" if num is None or den is None or den == 0 else f"{num / den:.2f}x"


def short_error(e: BaseException, limit: int = 160) -> str:
    """``Type: first line of the message``, truncated."""
    msg = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {msg}"[:limit]


def run_json_worker(
    cmd: list[str], timeout: float | None = None, env: dict[str, str] | None = None
) -> tuple[Any, dict[str, Any] | None]:
    """Run ``cmd`` in a fresh interpreter (cwd = repository root); parse the JSON on its last stdout line.

    Returns ``(result, None)`` on success, else ``(None, error_entry)`` where ``error_entry`` has
    ``error`` (one line) and ``stderr_tail`` (the last 20 lines of the worker's stderr or stdout).
    """
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, cwd=ROOT, check=False, timeout=timeout, env=env
        )
    except subprocess.TimeoutExpired as e:
        tail = (e.stderr or b"").decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        return None, {"error": f"worker timed out after {timeout:.0f}s", "stderr_tail": tail.splitlines()[-20:]}
    try:
        return json.loads(proc.stdout.strip().splitlines()[-1]), None
    except (IndexError, json.JSONDecodeError):
        tail = (proc.stderr or proc.stdout).strip().splitlines()
        err = f"worker exited {proc.returncode}: {tail[-1] if tail else ''}"[:160]
        return None, {"error": err, "stderr_tail": tail[-20:]}


def run_cold_cell(script: str, cell: dict[str, Any], timeout: float = 1800, src: str | None = None) -> dict[str, Any]:
    """``script --worker <cell as JSON>`` in a fresh interpreter with a new, empty TORCHINDUCTOR_CACHE_DIR
    (removed after): the worker's JSON result, or an error entry. `src`: import stampout from that tree's src."""
    import shutil
    import tempfile

    directory = tempfile.mkdtemp(prefix="stampout-bench-")
    try:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": directory}
        if src is not None:
            env["PYTHONPATH"] = os.pathsep.join((os.path.abspath(src), env.get("PYTHONPATH", "")))
        result, error = run_json_worker([sys.executable, os.path.abspath(script), "--worker", json.dumps(cell)],
                                        timeout=timeout, env=env)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return result if result is not None else error


def environment() -> dict[str, Any]:
    """Versions and machine facts recorded with every benchmark's raw numbers."""
    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "threads": torch.get_num_threads(),
    }


def write_json(path: str, payload: dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=1, default=str)


def finish(path: str, payload: dict[str, Any]) -> int:
    """Write a bench's raw numbers and say where (the exit code of a bench's main)."""
    write_json(path, payload)
    print(f"wrote {path} ({payload['total_s']:.1f}s)")
    return 0


def console(min_width: int = 160):
    """A rich Console at least ``min_width`` wide (tables stay on one line in logs)."""
    from rich.console import Console

    return Console(width=max(Console().width, min_width))


# ------------------------------------------------------------------------------ diffusers, small configs

DIFFUSERS_MODELS = ("sd3", "wan", "pixart")


def diffusers_model(name: str, layers: int, seed: int = 0) -> tuple[torch.nn.Module, dict[str, Any], list[str]]:
    """A small diffusers transformer built in code (no download): ``(model, call kwargs, repeated block
    class names)``. The block names are what ``compile_repeated_blocks`` compiles (SD3 and PixArt leave
    ``_repeated_blocks`` empty in diffusers 0.37, so callers set it on the instance)."""
    from diffusers import PixArtTransformer2DModel, SD3Transformer2DModel, WanTransformer3DModel

    gen = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if name == "sd3":
            model = SD3Transformer2DModel(
                sample_size=16, patch_size=2, in_channels=4, out_channels=4, num_layers=layers,
                attention_head_dim=16, num_attention_heads=4, joint_attention_dim=32, caption_projection_dim=64,
                pooled_projection_dim=32, pos_embed_max_size=16,
            )
            inputs = {"hidden_states": torch.randn(1, 4, 16, 16, generator=gen),
                      "encoder_hidden_states": torch.randn(1, 8, 32, generator=gen),
                      "pooled_projections": torch.randn(1, 32, generator=gen)}
            blocks = ["JointTransformerBlock"]
        elif name == "wan":
            model = WanTransformer3DModel(
                patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=16, in_channels=4, out_channels=4,
                text_dim=32, freq_dim=32, ffn_dim=128, num_layers=layers, rope_max_seq_len=32,
            )
            inputs = {"hidden_states": torch.randn(1, 4, 2, 16, 16, generator=gen),
                      "encoder_hidden_states": torch.randn(1, 8, 32, generator=gen)}
            blocks = ["WanTransformerBlock"]
        elif name == "pixart":
            model = PixArtTransformer2DModel(
                num_attention_heads=4, attention_head_dim=16, in_channels=4, out_channels=8, num_layers=layers,
                cross_attention_dim=64, sample_size=16, patch_size=2, caption_channels=32,
                norm_type="ada_norm_single", use_additional_conditions=False,
            )
            inputs = {"hidden_states": torch.randn(1, 4, 16, 16, generator=gen),
                      "encoder_hidden_states": torch.randn(1, 8, 32, generator=gen),
                      "added_cond_kwargs": {"resolution": None, "aspect_ratio": None}}
            blocks = ["BasicTransformerBlock"]
        else:
            raise ValueError(f"unknown diffusers model {name!r}; one of {DIFFUSERS_MODELS}")
    inputs.update(timestep=torch.tensor([500]), return_dict=False)
    return model, inputs, blocks


# ------------------------------------------------------------------ user-file and Hugging Face decoders

USER_AND_HF = ("user", "hf-llama")  # stampout.tools.benchmark's models, as `stampout bench` builds them
_NESTED: dict[type, type] = {}


def _nested_class(cls: type) -> type:
    """A subclass of a layer class whose forward is a nested_compile_region (class-level marking: torch 2.13's
    Dynamo feeds every layer the first layer's weights when the forward is rebound per instance)."""
    if cls not in _NESTED:
        _NESTED[cls] = type(cls.__name__, (cls,), {"forward": torch.compiler.nested_compile_region(cls.forward)})
    return _NESTED[cls]


def user_or_hf_model(name: str, layers: int, variant: str) -> tuple[torch.nn.Module, tuple, dict[str, Any]]:
    """A decoder defined in a user file (``user``: bench/user_model.py, guarded as a user's code is) or
    transformers' LlamaForCausalLM (``hf-llama``), small, on ids [2, 8]: ``(model, args, kwargs)``. `variant`:
    ``stampout`` (layers marked as stampout regions), ``torch_nested`` (nested_compile_region) or ``torch_flat``."""
    from stampout.tools.benchmark import build

    marked = {"stampout": "stampout_regions", "torch_nested": "dynamo_flat", "torch_flat": "dynamo_flat"}[variant]
    if name == "user" and variant == "torch_nested":
        marked = "dynamo_nested"  # (class-level marking: Decoder(regions="nested"))
    model, args, kwargs = build(name, layers, marked)
    if name == "hf-llama" and variant == "torch_nested":
        for layer in model.model.layers:
            layer.__class__ = _nested_class(type(layer))
    return model, args, kwargs
