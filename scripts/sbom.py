"""Write a CycloneDX 1.5 JSON SBOM of the Python environment this script runs in.

Run it with the interpreter of a fresh environment that has only the release installed
(scripts/build-release.sh does), so the SBOM lists exactly the runtime dependencies, with versions.

    python scripts/sbom.py OUTPUT.json ROOT_PACKAGE
"""

from __future__ import annotations

import datetime
import importlib.metadata as md
import json
import os
import re
import sys
import tempfile
import uuid

SKIP = {"pip", "setuptools", "wheel"}


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def main(out: str, root: str) -> None:
    dists = {norm(d.metadata["Name"]): d for d in md.distributions() if norm(d.metadata["Name"]) not in SKIP}
    components, dependencies = [], []
    for key in sorted(dists):
        d = dists[key]
        ref = f"pkg:pypi/{key}@{d.version}"
        licence = d.metadata.get("License-Expression") or d.metadata.get("License") or ""
        comp = {"type": "library", "bom-ref": ref, "name": d.metadata["Name"], "version": d.version, "purl": ref}
        if licence and len(licence) < 100:
            comp["licenses"] = (
                [{"expression": licence}] if "License-Expression" in d.metadata else [{"license": {"name": licence}}]
            )
        components.append(comp)
        requires = []
        for req in d.requires or []:
            if "extra ==" in req:
                continue
            name = norm(re.split(r"[ ;<>=!~\[(]", req, 1)[0])
            if name in dists:
                requires.append(f"pkg:pypi/{name}@{dists[name].version}")
        dependencies.append({"ref": ref, "dependsOn": sorted(set(requires))})
    root_dist = dists[norm(root)]
    bom = {
        "bomFormat": "CycloneDX",
        "specVersion": "1.5",
        "version": 1,
        "serialNumber": f"urn:uuid:{uuid.uuid4()}",
        "metadata": {
            "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "component": {
                "type": "application",
                "name": root_dist.metadata["Name"],
                "version": root_dist.version,
                "bom-ref": f"pkg:pypi/{norm(root)}@{root_dist.version}",
            },
        },
        "components": components,
        "dependencies": dependencies,
    }
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(out)) or ".")
    with os.fdopen(fd, "w") as fh:
        json.dump(bom, fh, indent=2)
    os.replace(tmp, out)
    print(f"wrote {out}: {len(components)} components")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
