"""Command-line options that ``chatkv repl`` and ``chatkv serve`` share, written once.

Each is a click decorator; applying one to a command adds a fresh option to it.
"""

from __future__ import annotations

import click

model_option = click.option(
    "--model", default=None,
    help="Model: 'default' (SmolLM2-135M-Instruct), a model directory, a .gguf file, or tiny:<arch>.")

dtype_option = click.option(
    "--dtype", type=click.Choice(["auto", "float32", "bfloat16", "float16"]), default=None,
    envvar="CHATKV_DTYPE", show_envvar=True,
    help="Weights and KV dtype. auto (default): bfloat16 on a CPU with native bf16 "
         "(AVX-512 BF16, AMX) or a CUDA GPU, float32 elsewhere. Sessions cached in one dtype "
         "re-prefill in another.")

compile_option = click.option(
    "--compile", "compile_mode", type=click.Choice(["auto", "on", "off"]), default=None,
    envvar="CHATKV_COMPILE", show_envvar=True,
    help="Compile the decode step, then the prefill step, with torch.compile, in the background "
         "after loading (about 1.2x faster decode, 1.1x faster prefill). "
         "auto (default): on the CPU where a C++ compiler is present. "
         "On a CUDA GPU, auto and on capture the decode step as CUDA graphs instead (about 13x "
         "faster decode for SmolLM2 on an H200).")

kv_quant_option = click.option(
    "--kv-quant", "kv_quant", default=None, metavar="SCHEME",
    help="How idle sessions' KV is compressed: none, bf16, fp16, int8, fp8 or int4 (engine-wide).")

disk_format_option = click.option(
    "--disk-format", "disk_format", type=click.Choice(["exact", "bf16", "fp16", "int8", "fp8", "int4"]),
    default="exact", show_default=True, envvar="CHATKV_DISK_FORMAT", show_envvar=True,
    help="How KV chunks are written to disk: exact, or compact (quantized; used only while it "
         "passes its fidelity floor for the model).")
