"""SGLang general-plugin entry point (group ``sglang.srt.plugins``), run once in every
SGLang process, the spawned scheduler included."""


def register() -> None:
    from sgl_vericache import sglang_adapter

    sglang_adapter.register_all()
