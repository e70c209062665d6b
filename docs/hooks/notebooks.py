"""MkDocs hook: publish the repository's notebooks/*.ipynb in the Notebooks section.

MkDocs renders only files inside docs_dir, but the notebooks live at the repository
root, where Jupyter, nbval and the packages expect them. This hook adds each one to
the build as ``notebooks/<name>.ipynb`` (mkdocs-jupyter then renders it from its
committed outputs), appends it to the "Notebooks" section of the nav in file-name
order, and writes the list of notebooks into docs/notebooks/index.md where that page
has the marker. With no notebooks it adds nothing. A hook rather than a symlink
docs/notebooks -> ../notebooks: it works the same in every clone and on every OS.
"""

from __future__ import annotations

import json
from pathlib import Path

from mkdocs.exceptions import PluginError
from mkdocs.plugins import event_priority
from mkdocs.structure.files import File

SECTION = "Notebooks"
OVERVIEW = "notebooks/index.md"
LIST_MARKER = "<!-- notebook-list -->"


def _notebooks(config) -> list[Path]:
    folder = Path(config.config_file_path).parent / "notebooks"
    found = sorted(folder.glob("*.ipynb"))
    if any(p.stem == "index" for p in found):
        raise PluginError("notebooks/index.ipynb would replace docs/notebooks/index.md; rename the notebook")
    return found


def _title(path: Path) -> str:
    """The notebook's first level-1 heading, else its file name."""
    cells = json.loads(path.read_text(encoding="utf-8")).get("cells", [])
    for cell in cells:
        if cell.get("cell_type") == "markdown":
            source = cell.get("source", "")
            for line in (source if isinstance(source, str) else "".join(source)).splitlines():
                if line.startswith("# "):
                    return line[2:].strip()
    return path.stem


def on_config(config):
    section = next((item[SECTION] for item in config.nav or [] if isinstance(item, dict) and SECTION in item), None)
    if section is None:
        raise PluginError(f"mkdocs.yml: the nav has no {SECTION!r} section for the notebooks")
    for path in _notebooks(config):
        entry = f"notebooks/{path.name}"
        if entry not in section:
            section.append(entry)
    return config


@event_priority(100)  # before mkdocs-jupyter's on_files, which turns the .ipynb files into pages
def on_files(files, config):
    root = Path(config.config_file_path).parent
    for path in _notebooks(config):
        # a plain File rooted at the repository (not File.generated): mkdocs-jupyter's wrapper
        # reads abs_src_path through src_dir, which a generated file does not have
        files.append(File(f"notebooks/{path.name}", src_dir=str(root), dest_dir=config.site_dir,
                          use_directory_urls=config.use_directory_urls))
    return files


def on_page_markdown(markdown, page, config, files):
    if page.file.src_uri != OVERVIEW or LIST_MARKER not in markdown:
        return markdown
    found = _notebooks(config)
    listing = "\n".join(f"- [{_title(p)}]({p.name})" for p in found) or "*No notebooks are committed yet.*"
    return markdown.replace(LIST_MARKER, listing)


def on_serve(server, config, builder):
    folder = Path(config.config_file_path).parent / "notebooks"
    if folder.is_dir():
        server.watch(str(folder))
    return server
