"""PLACEHOLDER for the generated references (issue 41): the real generator replaces this file.

It writes the four reference pages with a title each, so the site's nav resolves and
`mkdocs build --strict` passes until the generator (configuration keys, CLI, Python API,
captures.h5 layout) lands.
"""

import mkdocs_gen_files

PAGES = {
    "config.md": "Configuration keys",
    "cli.md": "Command line",
    "api.md": "Python API",
    "layout.md": "captures.h5 layout",
}
for name, title in PAGES.items():
    with mkdocs_gen_files.open(f"reference/{name}", "w") as page:
        page.write(f"# {title}\n\nGenerated from the code; not written yet.\n")
