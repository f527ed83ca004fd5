"""The marches fxpass knows, by name, with their BPU core counts.

Why a module of its own: ``load(path)`` checks a package's march against these names, and
``device.capability`` (which builds each march's operator set from the lowering table) imports
onnx and the rule set, a third of a second a deployed process has no use for."""

#: march -> BPU cores (``device.capability.MARCHES`` builds its ``March`` objects from this)
CORES: dict[str, int] = {"nash-e": 1, "nash-m": 1, "nash-p": 4, "nash-h": 3}
DEFAULT_MARCH = "nash-p"
