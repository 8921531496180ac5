"""The OpenAI API of a running `vllm serve`, through the ``openai`` client.

vLLM's own request fields (``ignore_eos``, ``return_token_ids``,
``vllm_xargs`` with the plugin's ``kv_eviction*`` keys) go in a call's
``extra_body``. A refused request raises ``openai.APIStatusError`` (its
``status_code`` and ``response.text``); a connection lost or a timeout,
``openai.APIConnectionError``.
"""

from __future__ import annotations

from openai import OpenAI


def openai_client(url: str, timeout: float, max_retries: int = 0) -> OpenAI:
    """A client of the server at ``url`` (``http://host:port``): ``timeout``
    seconds for each connect, read and write; no retry unless asked."""
    return OpenAI(base_url=url.rstrip("/") + "/v1", api_key="unused", timeout=timeout,
                  max_retries=max_retries)
