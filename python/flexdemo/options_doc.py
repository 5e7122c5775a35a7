"""Prints the optimizer's options as the Markdown table docs/python.md and docs/library.md hold
(``python -m flexdemo.options_doc``)."""

from .options import markdown

if __name__ == "__main__":
    print(markdown(), end="")
