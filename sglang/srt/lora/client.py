"""The tokenizer manager's side of /load_lora_adapter and /unload_lora_adapter: every scheduler replica loads
or unloads, and the names the API accepts follow the result."""

from __future__ import annotations

from typing import Any, Union

from sglang.srt.managers.io_struct import LoadLoRAAdapterReqInput, LoRAUpdateResult, UnloadLoRAAdapterReqInput


def parse_lora_update(body: Any, load: bool) -> Union[LoadLoRAAdapterReqInput, UnloadLoRAAdapterReqInput]:
    """The request body as a message; raises ValueError naming the field."""
    if not isinstance(body, dict):
        raise ValueError("The request body must be a JSON object.")
    name = body.get("lora_name")
    if not isinstance(name, str) or not name:
        raise ValueError("lora_name must be a non-empty string.")
    if not load:
        return UnloadLoRAAdapterReqInput(lora_name=name)
    path = body.get("lora_path")
    if not isinstance(path, str) or not path:
        raise ValueError("lora_path must be a non-empty string (the adapter's directory).")
    pinned = body.get("pinned", False)
    if not isinstance(pinned, bool):
        raise ValueError("pinned must be true or false.")
    return LoadLoRAAdapterReqInput(lora_name=name, lora_path=path, pinned=pinned)


async def update_lora_adapters(tm: Any, msg: Union[LoadLoRAAdapterReqInput, UnloadLoRAAdapterReqInput]
                               ) -> LoRAUpdateResult:
    if not (tm.server_args.enable_lora or tm.server_args.lora_paths):
        return LoRAUpdateResult(False, "LoRA is not enabled on this server; launch it with --enable-lora",
                                dict(tm.lora_adapters))
    result: LoRAUpdateResult = await tm.control.request(msg, LoRAUpdateResult)
    if result.success:
        tm.lora_adapters = dict(result.loaded_adapters)
    return result


def lora_result_body(result: LoRAUpdateResult) -> dict[str, Any]:
    """The response body: SGLang's fields, and `message` as the other update routes have it."""
    message = result.error_message or "Succeeded to update LoRA adapters."
    return {"success": result.success, "message": message, "error_message": result.error_message,
            "loaded_adapters": dict(result.loaded_adapters)}


def adapter_model_cards(base_card: dict[str, Any], adapters: dict[str, str]) -> list[dict[str, Any]]:
    """The /v1/models entries of the loaded adapters, as SGLang lists them: `id` the adapter's name, `root` its
    path, `parent` the served model."""
    return [{**base_card, "id": name, "root": path, "parent": base_card["id"], "max_model_len": None}
            for name, path in adapters.items()]
