"""The server's structured output: OpenAI's response_format (json_schema, json_object) and
vLLM's guided_* fields, through the real `openai` client; bad constraints are 400s naming the
field, and nothing is left in the engine."""

from __future__ import annotations

import functools
import json
import re
import sys

import pytest
import torch

pytest.importorskip("xgrammar")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

from hf_paged.engine.engine import Engine  # noqa: E402
from hf_paged.entrypoints.api_server import build_app  # noqa: E402
from hf_paged.entrypoints.core_messages import EngineSpec  # noqa: E402
from hf_paged.entrypoints.engine_client import EngineProcess  # noqa: E402
from hf_paged.entrypoints.serve import build_parser, load, load_tokenizer  # noqa: E402
from hf_paged.entrypoints.server_thread import ServerThread  # noqa: E402

KEY = "test-key"
MODEL = "tiny-llama"
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}, "n": {"type": "integer"}},
    "required": ["city", "n"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module", params=["thread", "process"])
def served(request, tmp_path_factory):
    """(the front, the server), the engine in this process or in one of its own."""
    import tests.test_structured_output as structured  # the JSON-capable tokenizer

    conftest = sys.modules["tests.conftest"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    options = dict(num_blocks=128, max_num_seqs=16, max_model_len=160)
    if request.param == "thread":
        engine = Engine(conftest.build_model("llama"), structured.json_tokenizer(), **options)
    else:
        folder = tmp_path_factory.mktemp("structured")
        conftest.build_model("llama").save_pretrained(folder)
        structured.json_tokenizer().save_pretrained(folder)
        args = build_parser().parse_args([str(folder), "--engine-process"])
        spec = EngineSpec(functools.partial(load, args), options)
        engine = EngineProcess(spec, load_tokenizer(args))
    app = build_app(engine, MODEL, api_key=KEY)
    try:
        with ServerThread(app) as server:
            yield app.state.front, server
    finally:
        if request.param == "process":
            engine.close()
        torch.set_num_threads(threads)


@pytest.fixture
def client(served):
    return openai.OpenAI(base_url=served[1].url + "/v1", api_key=KEY, max_retries=0)


def clean(s: str) -> str:
    return s.replace("▁", " ")


def test_response_format_and_guided_fields(served, client):
    front, _ = served
    fmt = {"type": "json_schema", "json_schema": {"name": "place", "schema": SCHEMA}}
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "a city"}],
        max_tokens=60,
        temperature=0.7,
        response_format=fmt,
    )
    jsonschema.validate(json.loads(clean(chat.choices[0].message.content)), SCHEMA)
    anyjson = client.completions.create(
        model=MODEL,
        prompt="data",
        max_tokens=60,
        temperature=0.7,
        seed=3,
        extra_body={"response_format": {"type": "json_object"}},
    )
    json.loads(clean(anyjson.choices[0].text))
    regex = client.completions.create(
        model=MODEL, prompt="x", max_tokens=20, extra_body={"guided_regex": r"[a-d]{4}"}
    )
    assert re.fullmatch("[a-d]{4}", regex.choices[0].text)
    choice = client.completions.create(
        model=MODEL, prompt="x", max_tokens=20, extra_body={"guided_choice": ["up", "down"]}
    )
    assert choice.choices[0].text in ("up", "down")
    plain = client.completions.create(
        model=MODEL, prompt="x", max_tokens=4, extra_body={"response_format": {"type": "text"}}
    )
    assert plain.usage.completion_tokens >= 1
    front.check_idle()


@pytest.mark.parametrize(
    "body, param",
    [
        ({"response_format": {"type": "json_schema", "json_schema": {}}}, "response_format"),
        ({"response_format": {"type": "yaml"}}, "response_format"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 3}}}},
            "response_format",
        ),
        ({"guided_regex": "(ab"}, "guided_regex"),
        ({"guided_json": "{oops"}, "guided_json"),
        ({"guided_grammar": "root ::= nothing_here"}, "guided_grammar"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ],
)
def test_bad_constraints_are_400_naming_the_field(served, client, body, param):
    front, _ = served
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="x", max_tokens=8, extra_body=body)
    assert info.value.body["param"] == param, info.value.body
    ok = client.completions.create(model=MODEL, prompt="x", max_tokens=3)
    assert ok.usage.completion_tokens >= 1
    front.check_idle()
