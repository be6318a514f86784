"""The benchmark scripts' one output step: a table's lines printed, and written to a file where asked."""


def emit(lines: list, out_path: str | None) -> None:
    """Print `lines` as one text and, where `out_path` is given, write it there."""
    text = "\n".join(lines)
    print(text)
    if out_path:
        with open(out_path, "w", encoding="utf-8") as f:
            f.write(text + "\n")
