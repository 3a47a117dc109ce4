"""The engine flags shared by ``swaserve serve`` and the workers (``services/worker_cli.py``):
``ENGINE_OPTIONS`` (one definition: name, typer annotation, default), the ``engine_options``
decorator that turns them into one ``EngineConfig`` parameter, and byte sizes (``parse_size``).
The HTTP front's and the gRPC TLS flags: ``swaserve.front_options``.
Light to import: typer and ``swaserve.config`` only.
"""

from __future__ import annotations

import copy
import functools
import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal, TypeVar, get_args

import typer

from swaserve.config import EngineConfig

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1024, "ki": 1024, "kib": 1024, "kb": 1000,
    "m": 1024**2, "mi": 1024**2, "mib": 1024**2, "mb": 1000**2,
    "g": 1024**3, "gi": 1024**3, "gib": 1024**3, "gb": 1000**3,
    "t": 1024**4, "ti": 1024**4, "tib": 1024**4, "tb": 1000**4,
}  # fmt: skip


def parse_size(text: str) -> int:
    """Parse a byte size: ``1073741824``, ``256MiB``, ``1.5GiB``, ``1GB``, ``512M``.

    ``KiB/MiB/GiB/TiB`` and the bare ``K/M/G/T`` (also ``Ki/Mi/...``) are powers of 1024;
    ``KB/MB/GB/TB`` are powers of 1000. Case-insensitive.

    Raises:
        ValueError: Not a size, or not positive.
    """
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _SIZE_UNITS:
        raise ValueError(f"bad size {text!r} (examples: 268435456, 256MiB, 1GiB, 1GB)")
    value = int(float(m.group(1)) * _SIZE_UNITS[unit])
    if value <= 0:
        raise ValueError(f"size must be positive, got {text!r}")
    return value


def size_option(text: str) -> int:
    """``parse_size`` for a typer option's ``parser``: a bad size is a ``typer.BadParameter``."""
    try:
        return parse_size(text)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from e


@dataclass(frozen=True)
class EngineOption:
    """One engine flag: parameter name (``page_size`` -> ``--page-size``), typer annotation, default."""

    name: str
    annotation: Any
    default: Any


ENGINE_OPTIONS: tuple[EngineOption, ...] = (
    EngineOption("page_size", Annotated[int, typer.Option(min=1, help="Tokens per KV page.")], 16),
    EngineOption(
        "kv_cache_memory",
        Annotated[
            int, typer.Option(parser=size_option, metavar="BYTES", help="KV cache bytes, e.g. 256MiB, 1GB.")
        ],
        "256MiB",
    ),
    EngineOption(
        "kv_layout",
        Annotated[
            Literal["hybrid", "full"],
            typer.Option(help="hybrid: SWA layers keep only their window; full: baseline."),
        ],
        "hybrid",
    ),
    EngineOption(
        "max_num_seqs", Annotated[int, typer.Option(min=1, help="Most requests running at once.")], 64
    ),
    EngineOption(
        "max_num_batched_tokens",
        Annotated[int, typer.Option(min=1, help="Token budget per engine step.")],
        512,
    ),
    EngineOption(
        "max_model_len",
        Annotated[int | None, typer.Option(min=1, help="Longest prompt+output (default: model's).")],
        None,
    ),
    EngineOption(
        "dtype",
        Annotated[Literal["float32", "bfloat16", "float16"], typer.Option(help="Activation and KV dtype.")],
        "float32",
    ),
    EngineOption(
        "device",
        Annotated[str | None, typer.Option(help="cpu, cuda, cuda:1... (default: CUDA if present).")],
        None,
    ),
    EngineOption("seed", Annotated[int, typer.Option(help="Engine sampling seed.")], 0),
    EngineOption(
        "enable_prefix_caching",
        Annotated[bool, typer.Option(help="Reuse cached prefixes' KV (SWA-aware radix tree).")],
        True,
    ),
    EngineOption(
        "host_cache_memory",
        Annotated[
            int | None,
            typer.Option(
                parser=size_option,
                metavar="BYTES",
                help="Host-memory KV tier behind the device pools (default: none).",
            ),
        ],
        None,
    ),
    EngineOption(
        "host_write_policy",
        Annotated[
            Literal["on_evict", "second_hit"],
            typer.Option(
                help="When pages get a host copy: when evicted from device, or on their second hit."
            ),
        ],
        "on_evict",
    ),
    EngineOption(
        "swa_full_tokens_ratio",
        Annotated[
            float | None,
            typer.Option(
                min=0.0,
                help="With prefix caching: a fixed split, SWA-pool pages per full-pool page "
                "(default: one KV arena split by the traffic; see kvcache.adaptive).",
            ),
        ],
        None,
    ),
    EngineOption(
        "schedule_policy",
        Annotated[
            Literal["fcfs", "compute"],
            typer.Option(
                help="Admission order: fcfs, or compute (fewest uncached tokens first, aged, bounded)."
            ),
        ],
        "fcfs",
    ),
    EngineOption(
        "priority_max_wait_s",
        Annotated[
            float, typer.Option(min=0.0, help="compute: no request waits past this (s) for a shorter one.")
        ],
        30.0,
    ),
    EngineOption(
        "priority_wait_weight",
        Annotated[
            float, typer.Option(min=0.0, help="compute: seconds of work one second of waiting is worth.")
        ],
        0.1,
    ),
    EngineOption(
        "cost_model",
        Annotated[
            Literal["cpu-tiny", "mimo-v2-flash-h200"],
            typer.Option(help="compute: cost-model preset for prefill times (swaserve.sched.cost)."),
        ],
        "cpu-tiny",
    ),
    EngineOption(
        "speculative_num_steps",
        Annotated[
            int,
            typer.Option(
                min=0,
                help="MTP speculative decoding: draft tokens per step, one per MTP layer (0 = off; "
                "at most the checkpoint's num_nextn_predict_layers). Greedy output is unchanged.",
            ),
        ],
        0,
    ),
    EngineOption(
        "ep_size",
        Annotated[
            int,
            typer.Option(
                min=1,
                help="Expert parallelism: ranks (processes) of this instance, each holding 1/N of the "
                "routed experts and its own requests (data-parallel attention); tokens go to the ranks "
                "of their experts and back (all-to-all). 1 = off. Needs --engine-process separate/auto.",
            ),
        ],
        1,
    ),
    EngineOption(
        "ep_placement",
        Annotated[
            str | None,
            typer.Option(help='EP: a JSON file {"ranks": [[experts of rank 0], ...]} (default: contiguous).'),
        ],
        None,
    ),
    EngineOption(
        "ep_timeout_s",
        Annotated[
            float,
            typer.Option(
                min=1.0,
                help="EP: seconds a rank waits for its peers in a collective before the instance exits.",
            ),
        ],
        60.0,
    ),
    EngineOption(
        "ep_launcher",
        Annotated[
            Literal["process", "ray"],
            typer.Option(
                help="EP: start the ranks as child processes, or as Ray actors in one placement "
                "group (gang-placed on one node; a dead actor ends the instance). Ray: "
                "pip install 'swaserve[ray]'.",
            ),
        ],
        "process",
    ),
    EngineOption(
        "ray_address",
        Annotated[
            str | None,
            typer.Option(
                help="EP with --ep-launcher ray: the Ray cluster to join (default: RAY_ADDRESS, else a "
                "local Ray on 127.0.0.1 started by this process)."
            ),
        ],
        None,
    ),
    EngineOption(
        "kv_cache_dtype",
        Annotated[
            Literal["auto", "fp8_e4m3", "fp8_e5m2", "int8", "kivi2", "kivi4"],
            typer.Option(
                help="Page format of the full-attention pool: auto (--dtype) or quantized with a "
                "per-token scale (fp8_e4m3, fp8_e5m2, int8): about half of bf16's bytes; kivi2/kivi4: KIVI 2/4-bit "
                "keys per channel over token groups, values per token, the last --kv-kivi-residual "
                "tokens in full precision (kept in the SWA pool).",
            ),
        ],
        "auto",
    ),
    EngineOption(
        "kv_cache_dtype_swa",
        Annotated[
            Literal["auto", "fp8_e4m3", "fp8_e5m2", "int8", "kivi2", "kivi4"] | None,
            typer.Option(help="Page format of the SWA pool (default: --kv-cache-dtype's)."),
        ],
        None,
    ),
    EngineOption(
        "kv_kivi_group",
        Annotated[
            int,
            typer.Option(min=0, help="KIVI: tokens per key group (divides --page-size; 0: the page size)."),
        ],
        0,
    ),
    EngineOption(
        "kv_kivi_residual",
        Annotated[
            int,
            typer.Option(
                min=0,
                help="KIVI: recent tokens read in full precision (key group .. window; 0: min(128, W)).",
            ),
        ],
        0,
    ),
    EngineOption(
        "kv_sink_tokens",
        Annotated[
            int,
            typer.Option(
                min=0,
                help="Attention sinks: the first N prompt tokens' full-layer K/V read in full "
                "precision (computed by a forward over those tokens alone), not from quantized "
                "pages. Needs a quantized --kv-cache-dtype. 0: off.",
            ),
        ],
        0,
    ),
    EngineOption(
        "kv_quant_group",
        Annotated[
            int,
            typer.Option(
                min=0, help="Channels per scale of a quantized KV format (0: one per token and head)."
            ),
        ],
        0,
    ),
    EngineOption(
        "l3_url",
        Annotated[
            str | None,
            typer.Option(
                help="L3 KV cache (GCache) behind the host tier: gcache://HOST:PORT (one node), "
                "redis://... (the nodes registered there), local://NAME (in this process). Needs "
                "--host-cache-memory. Default: none. From the environment when not given (keeps a "
                "Redis password out of the process list).",
                envvar="SWASERVE_L3_URL",
                show_envvar=True,
            ),
        ],
        None,
    ),
    EngineOption(
        "l3_min_tokens",
        Annotated[int, typer.Option(min=1, help="L3: the least hit extension worth a fetch (tokens).")],
        256,
    ),
    EngineOption(
        "l3_timeout_s",
        Annotated[
            float,
            typer.Option(
                min=0.0, help="L3: a fetch's deadline (s), plus --l3-timeout-per-ki-token-s per 1024 tokens."
            ),
        ],
        2.0,
    ),
    EngineOption(
        "l3_timeout_per_ki_token_s",
        Annotated[
            float, typer.Option(min=0.0, help="L3: seconds added to a fetch's deadline per 1024 tokens.")
        ],
        0.1,
    ),
    EngineOption(
        "weights_id",
        Annotated[
            str | None,
            typer.Option(
                help="L3: the weights' identity in page keys (default: a digest of the *.safetensors "
                "files, read once at start). Another model's or fine-tune's pages are never read.",
            ),
        ],
        None,
    ),
    EngineOption(
        "engine_process",
        Annotated[
            Literal["auto", "inline", "separate"],
            typer.Option(
                help="Where the engine core steps: inline (on the server's event loop), separate "
                "(its own process; probes and streams never wait for a step), auto (= separate; engine.factory)."
            ),
        ],
        "auto",
    ),
    EngineOption(
        "engine_step_timeout",
        Annotated[
            float,
            typer.Option(
                min=0.0,
                help="Separate core: seconds a core holding work may stay silent (one step) before it is "
                "killed as hung, its streams ended and the process exits 1; 0 = never.",
            ),
        ],
        120.0,
    ),
)
"""The engine flags of ``swaserve serve`` and of every worker (``engine_options``): a flag added
here exists for both, with the same name, default and help."""

F = TypeVar("F", bound=Callable[..., Any])


def engine_options(**overrides: tuple[Any, str]) -> Callable[[F], F]:
    """Decorator for a typer command: its ``engine_config: EngineConfig`` parameter becomes the
    ``ENGINE_OPTIONS`` flags (in its place), and the command receives their values as one
    ``EngineConfig``.

    Args:
        overrides: ``name=(default, help)`` for a flag whose default differs in this command.
    """
    unknown = set(overrides) - {o.name for o in ENGINE_OPTIONS}
    if unknown:
        raise ValueError(f"no engine option {sorted(unknown)}")

    def wrap(func: F) -> F:
        options = []
        for o in ENGINE_OPTIONS:
            annotation, default = o.annotation, o.default
            if o.name in overrides:
                default, help_text = overrides[o.name]
                base, info = get_args(annotation)
                info = copy.copy(info)
                info.help = help_text
                annotation = Annotated[base, info]
            options.append(
                inspect.Parameter(
                    o.name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation
                )
            )
        sig = inspect.signature(func, eval_str=True)
        if "engine_config" not in sig.parameters:
            raise TypeError(f"{func.__name__} has no engine_config parameter")
        params: list[inspect.Parameter] = []
        for p in sig.parameters.values():  # keyword-only: typer passes everything by name
            params += (
                options if p.name == "engine_config" else [p.replace(kind=inspect.Parameter.KEYWORD_ONLY)]
            )

        @functools.wraps(func)
        def command(**kwargs: Any) -> Any:
            values = {o.name: kwargs.pop(o.name) for o in ENGINE_OPTIONS}
            return func(**kwargs, engine_config=build_engine_config(**values))

        command.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
        command.__annotations__ = {p.name: p.annotation for p in params}
        return command  # type: ignore[return-value]

    return wrap


def build_engine_config(**values: Any) -> EngineConfig:
    """An ``EngineConfig`` from the values of the ``ENGINE_OPTIONS`` flags."""
    return EngineConfig(**{**values, "host_cache_memory": values.get("host_cache_memory") or 0})
