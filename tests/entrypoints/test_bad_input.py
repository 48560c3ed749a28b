"""Bad requests get the right status and an OpenAI error body naming the field; the server stays healthy."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.entrypoints.conftest import API_KEY, MAX_MODEL_LEN, MODEL

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
HI = [{"role": "user", "content": "Hi"}]
LONG_PROMPT = "hello " * (MAX_MODEL_LEN + 100)

# (case id, path, JSON body or raw bytes, expected status, expected `param`, text the message must contain)
CASES = [
    ("malformed_json", CHAT, b'{"messages": [{"role": "user", "content": "Hi"}', 400, None, "JSON"),
    ("body_not_object", CHAT, b'[1, 2]', 400, None, ""),
    ("max_tokens_wrong_type", CHAT, {"messages": HI, "max_tokens": "lots"}, 400, "max_tokens", "integer"),
    ("messages_wrong_type", CHAT, {"messages": "Hi"}, 400, "messages", "list"),
    ("temperature_wrong_type", COMPLETIONS, {"prompt": "Hi", "temperature": "hot"}, 400, "temperature", "number"),
    ("stream_wrong_type", CHAT, {"messages": HI, "stream": "maybe"}, 400, "stream", "bool"),
    ("negative_max_tokens", CHAT, {"messages": HI, "max_tokens": -5}, 400, "max_tokens", ""),
    ("zero_max_completion_tokens", CHAT, {"messages": HI, "max_completion_tokens": 0}, 400,
     "max_completion_tokens", ""),
    ("huge_max_tokens", CHAT, {"messages": HI, "max_tokens": 10**9}, 400, "max_tokens", "maximum context length"),
    ("huge_max_tokens_completion", COMPLETIONS, {"prompt": "Hi", "max_tokens": MAX_MODEL_LEN}, 400, "max_tokens",
     "maximum context length"),
    ("empty_messages", CHAT, {"messages": []}, 400, "messages", "at least 1"),
    ("missing_messages", CHAT, {"max_tokens": 3}, 400, "messages", "required"),
    ("missing_prompt", COMPLETIONS, {"max_tokens": 3}, 400, "prompt", "required"),
    ("empty_role", CHAT, {"messages": [{"role": "", "content": "Hi"}]}, 400, "messages.0.role", "at least 1"),
    ("zero_max_tokens_without_echo", COMPLETIONS, {"prompt": "Hi", "max_tokens": 0}, 400, "max_tokens", "echo"),
    ("logit_bias_not_a_token", CHAT, {"messages": HI, "logit_bias": {"abc": 1}}, 400, "logit_bias", "token id"),
    ("logit_bias_too_big", CHAT, {"messages": HI, "logit_bias": {"12": 1000}}, 400, "logit_bias", "[-100, 100]"),
    ("truncation_side", CHAT, {"messages": HI, "truncate_prompt_tokens": 5, "truncation_side": "middle"}, 400,
     "truncation_side", ""),
    ("truncate_prompt_tokens_too_big", COMPLETIONS, {"prompt": "Hi", "truncate_prompt_tokens": MAX_MODEL_LEN}, 400,
     "truncate_prompt_tokens", "maximum context length"),
    ("beam_search_with_regex", CHAT, {"messages": HI, "use_beam_search": True, "guided_regex": "a+"}, 400,
     "guided_regex", "use_beam_search"),
    ("prompt_logprobs_over_limit", COMPLETIONS, {"prompt": "Hi", "prompt_logprobs": 1000}, 400, "prompt_logprobs",
     "at most"),
    ("image_content", CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url",
                                                                         "image_url": {"url": "x"}}]}]},
     400, "messages.0.content.0", "takes no images"),
    ("over_long_chat", CHAT, {"messages": [{"role": "user", "content": LONG_PROMPT}]}, 400, "messages",
     "maximum context length"),
    ("over_long_prompt", COMPLETIONS, {"prompt": LONG_PROMPT, "max_tokens": 1}, 400, "prompt",
     "maximum context length"),
    ("over_long_token_ids", COMPLETIONS, {"prompt": [1] * MAX_MODEL_LEN}, 400, "prompt", "maximum context length"),
    ("empty_prompt", COMPLETIONS, {"prompt": ""}, 400, "prompt", "empty"),
    ("empty_prompt_list", COMPLETIONS, {"prompt": []}, 400, "prompt", "empty"),
    ("token_id_out_of_vocab", COMPLETIONS, {"prompt": [1, 10**7]}, 400, "prompt", "prompt_token_ids"),
    ("negative_temperature", CHAT, {"messages": HI, "temperature": -1}, 400, "temperature", "temperature"),
    ("top_p_zero", CHAT, {"messages": HI, "top_p": 0}, 400, "top_p", "top_p"),
    ("presence_penalty_range", CHAT, {"messages": HI, "presence_penalty": 5}, 400, "presence_penalty", ""),
    ("n_zero", CHAT, {"messages": HI, "n": 0}, 400, "n", ""),
    ("min_tokens_above_max", CHAT, {"messages": HI, "max_tokens": 2, "min_tokens": 5}, 400, "min_tokens", ""),
    ("negative_stop_token_id", CHAT, {"messages": HI, "stop_token_ids": [-1]}, 400, "stop_token_ids", ""),
    ("empty_stop_string", CHAT, {"messages": HI, "stop": [""]}, 400, "stop", "stop"),
    ("top_logprobs_too_many", CHAT, {"messages": HI, "logprobs": True, "top_logprobs": 50}, 400, "top_logprobs", ""),
    ("top_logprobs_without_logprobs", CHAT, {"messages": HI, "top_logprobs": 2}, 400, "top_logprobs", ""),
    ("suffix_unsupported", COMPLETIONS, {"prompt": "Hi", "suffix": "!"}, 400, "suffix", "suffix"),
    ("tools_auto_without_flag", CHAT, {"messages": HI, "tools": [{"type": "function", "function": {"name": "f"}}]},
     400, "tool_choice", "--enable-auto-tool-choice"),
    ("tool_choice_auto_without_flag", CHAT, {"messages": HI, "tool_choice": "auto",
                                             "tools": [{"type": "function", "function": {"name": "f"}}]},
     400, "tool_choice", "--enable-auto-tool-choice"),
    ("continue_final_needs_assistant", CHAT, {"messages": HI, "continue_final_message": True}, 400,
     "continue_final_message", "assistant"),
    ("broken_chat_template", CHAT, {"messages": HI, "chat_template": "{% for %}"}, 400, "chat_template",
     "template"),
    ("stream_options_without_stream", CHAT, {"messages": HI, "stream_options": {"include_usage": True}}, 400,
     "stream_options", "stream"),
    ("priority_without_priority_policy", CHAT, {"messages": HI, "priority": 1}, 400, "priority", "priority"),
    ("unknown_model", CHAT, {"model": "gpt-4o", "messages": HI}, 404, "model", "gpt-4o"),
    ("unknown_model_completion", COMPLETIONS, {"model": "nope", "prompt": "Hi"}, 404, "model", "nope"),
    ("detokenize_bad_id", "/detokenize", {"tokens": [-3]}, 400, "tokens", "tokens"),
]


@pytest.mark.parametrize("path,body,status,param,text", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_request(http, path, body, status, param, text):
    if isinstance(body, bytes):
        r = http.post(path, content=body, headers={"Content-Type": "application/json"})
    else:
        r = http.post(path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == status and err["type"].endswith("Error")
    if param is None:
        assert err["param"] is None
    else:
        assert param in (err["param"] or "").split(","), err
    assert text.lower() in err["message"].lower(), err


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong-key"}, {"Authorization": API_KEY}],
                         ids=["missing", "wrong", "no_bearer"])
def test_bad_api_key(server, headers):
    for path in ("/v1/models", CHAT, "/tokenize"):
        r = httpx.request("GET" if path == "/v1/models" else "POST", server.url + path, headers=headers,
                          json={"messages": HI}, timeout=30)
        assert r.status_code == 401, r.text
        assert r.json()["error"]["code"] == 401 and r.json()["error"]["type"] == "AuthenticationError"
    # probes stay open without a key
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200
    assert httpx.get(server.url + "/metrics", timeout=30).status_code == 200


def test_openai_client_raises_typed_errors(server, client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=HI, temperature=-2)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=HI)
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_unknown_route_is_an_openai_404(http):
    r = http.get("/v1/does-not-exist")
    assert r.status_code == 404 and r.json()["error"]["code"] == 404


def test_healthy_after_bad_input(server, client):
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200
    r = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=3, temperature=0)
    assert r.choices[0].message.content
    m = server.wait_idle()
    assert m["pagemill:kv_cache_usage_perc"] == 0.0
