"""hf_paged/envs.py is the one place the library, its kernels and its evals read the environment."""

from __future__ import annotations

import re
from pathlib import Path

from hf_paged import envs

ROOT = Path(__file__).resolve().parents[1]
_READ = re.compile(r"os\.environ\s*(\.get|\[|\.setdefault|\.pop)|os\.getenv|getenv\(")


def test_no_module_but_the_registry_reads_the_environment():
    readers = []
    for folder in ("hf_paged", "kernels", "integrations", "evals"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path == ROOT / "hf_paged" / "envs.py":
                continue
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if _READ.search(line):
                    readers.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not readers, readers
    assert (ROOT / "hf_paged" / "envs.py").read_text().count("os.environ.get(") == len(
        envs.environment_variables
    )


def test_variables_are_read_when_asked_not_at_import(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_PAGED_CACHE", str(tmp_path))
    assert envs.HF_PAGED_CACHE == tmp_path
    monkeypatch.delenv("HF_PAGED_CACHE")
    assert envs.HF_PAGED_CACHE == Path.home() / ".cache" / "hf_paged"
    monkeypatch.setenv("PIP_INDEX_URL", "http://index.example/simple")
    assert envs.PIP_INDEX_URL == "http://index.example/simple"
    assert sorted(dir(envs)) == sorted(envs.environment_variables)


def _without_cache_folders(monkeypatch) -> None:
    for name in envs.COMPILE_CACHE_DIRS:  # set first: the test's end puts back what was there
        monkeypatch.setenv(name, "placeholder")
        monkeypatch.delenv(name)


def test_compile_cache_points_inductor_and_triton_into_one_folder(monkeypatch, tmp_path):
    import triton
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    _without_cache_folders(monkeypatch)
    monkeypatch.setenv("HF_PAGED_COMPILE_CACHE", str(tmp_path))
    assert envs.HF_PAGED_COMPILE_CACHE == tmp_path
    inductor, triton_dir = (str((tmp_path / sub).resolve()) for sub in ("inductor", "triton"))
    assert envs.use_compile_cache() == {
        "TORCHINDUCTOR_CACHE_DIR": inductor,
        "TRITON_CACHE_DIR": triton_dir,
    }
    # what the libraries themselves read now
    assert cache_dir() == inductor
    assert triton.knobs.cache.dir == triton_dir


def test_compile_cache_leaves_a_users_own_folders_alone(monkeypatch, tmp_path):
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "my-triton"))
    monkeypatch.setenv("HF_PAGED_COMPILE_CACHE", str(tmp_path / "cc"))
    assert envs.use_compile_cache() == {}
    assert envs.TORCHINDUCTOR_CACHE_DIR == tmp_path / "mine"
    assert envs.TRITON_CACHE_DIR == tmp_path / "my-triton"
    # inductor's default is no user's choice: torch writes it itself when torch._dynamo is
    # imported (transformers' from_pretrained does)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())
    ours = str((tmp_path / "cc" / "inductor").resolve())
    assert envs.use_compile_cache() == {"TORCHINDUCTOR_CACHE_DIR": ours}
    assert envs.TORCHINDUCTOR_CACHE_DIR == Path(ours)
    assert envs.TRITON_CACHE_DIR == tmp_path / "my-triton"
    # an explicit folder (hf-paged warmup --compile-cache) over the variable; neither: no change
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "my-triton"))
    monkeypatch.delenv("HF_PAGED_COMPILE_CACHE")
    assert envs.use_compile_cache() == {}
    monkeypatch.delenv("TRITON_CACHE_DIR")
    chosen = envs.use_compile_cache(tmp_path / "given")
    assert chosen == {"TRITON_CACHE_DIR": str((tmp_path / "given" / "triton").resolve())}


def test_an_engine_points_the_caches_before_it_compiles(monkeypatch, tmp_path, tiny_model):
    from hf_paged import Engine
    from hf_paged.worker import model_runner

    _without_cache_folders(monkeypatch)
    monkeypatch.setenv("HF_PAGED_COMPILE_CACHE", str(tmp_path))
    seen = []
    real = model_runner.ModelForward

    def forward(*args, **kwargs):  # where torch.compile wraps the model
        seen.append((envs.TORCHINDUCTOR_CACHE_DIR, envs.TRITON_CACHE_DIR))
        return real(*args, **kwargs)

    monkeypatch.setattr(model_runner, "ModelForward", forward)
    Engine(tiny_model("llama")).shutdown()
    assert seen == [((tmp_path / "inductor").resolve(), (tmp_path / "triton").resolve())]
