"""SGLang general-plugin entry point (group ``sglang.srt.plugins``), run once in every
SGLang process, the spawned scheduler included."""


def register() -> None:
    from sgl_vericache.sglang import register_all

    register_all()
