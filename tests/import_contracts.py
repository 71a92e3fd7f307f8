"""A contract type for import-linter (`task lint`): no package imports another package's
private modules. `m27.sim._traces` is the simulator's business; the CLI imports what
`m27.sim` exports. Within one top-level package (`m27.sim.*`) anything goes."""

from __future__ import annotations

from typing import Any

import grimp
from importlinter import Contract, ContractCheck, fields, output


def _private(module: str) -> bool:
    return any(part.startswith("_") and not part.startswith("__")
               for part in module.split("."))


class NoPrivateImportsContract(Contract):
    """Options: `root` (e.g. m27): the packages directly under it are the units."""

    type_name = "no_private_imports"
    root = fields.StringField()

    def check(self, graph: grimp.ImportGraph, verbose: bool) -> ContractCheck:
        root = str(self.root)
        unit = len(root.split(".")) + 1
        broken: list[dict[str, Any]] = []
        for importer in sorted(graph.modules):
            mine = importer.split(".")[:unit]
            for imported in sorted(graph.find_modules_directly_imported_by(importer)):
                if imported.split(".")[:unit] == mine or not imported.startswith(root + "."):
                    continue
                if _private(imported):
                    details = graph.get_import_details(importer=importer, imported=imported)
                    broken.append({"importer": importer, "imported": imported,
                                   "lines": [d["line_number"] for d in details]})
        return ContractCheck(kept=not broken, metadata={"broken": broken})

    def render_broken_contract(self, check: ContractCheck) -> None:
        for item in check.metadata["broken"]:
            lines = ", ".join(f"l.{n}" for n in item["lines"])
            output.print_error(f"{item['importer']} -> {item['imported']} ({lines}): "
                               "a private module of another package; import a public name")
            output.new_line()
