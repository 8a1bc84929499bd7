"""Every built-in passes its contract suite, and the suites fail a backend or scheme that breaks them."""

from __future__ import annotations

import pytest

from kvcdn_core.builtin.local_storage import LocalStorage
from kvcdn_core.contracts.storage import StorageBackend
from kvcdn_core.errors import KvcdnError
from kvcdn_core.plugin_host import registry
from kvcdn_core.testing import assert_quantizer_contract, assert_storage_contract


def test_local_storage_passes_the_storage_contract(tmp_path):
    roots = iter(range(100))
    assert_storage_contract(lambda: LocalStorage(tmp_path / f"root{next(roots)}"))


def test_local_storage_through_a_file_uri_passes(tmp_path):
    roots = iter(range(100))
    assert_storage_contract(lambda: registry.open_storage(f"file://{tmp_path}/uri{next(roots)}"))


@pytest.mark.parametrize("scheme", ["int8", "int8-tensor", "fp8"])
def test_builtin_quantizers_pass_the_quantizer_contract(scheme):
    assert_quantizer_contract(registry.quantizer_for(scheme))


class _ListsUnsorted(LocalStorage):
    def list(self, prefix=""):
        return list(reversed(super().list(prefix)))


class _LosesRenames(LocalStorage):
    def rename(self, source_key, target_key):
        self.delete(source_key)


class _WrongMissingError(LocalStorage):
    def rename(self, source_key, target_key):
        if not self.exists(source_key):
            raise FileNotFoundError(source_key)
        super().rename(source_key, target_key)


class _KvOnly(LocalStorage):
    """A medium that keeps only .kv artifacts and has no rename, declared and refused as the contract says."""

    stores = "kv"
    unsupported = frozenset({"rename"})

    def put_file(self, key, source):
        from kvcdn_core import ArtifactError, NotSupported, artifact

        try:
            artifact.read_header(source)
        except ArtifactError as exc:
            raise NotSupported(f"only .kv artifacts: {exc}") from None
        super().put_file(key, source)

    def write_bytes(self, key, data):
        StorageBackend.write_bytes(self, key, data)  # through put_file, which checks

    def rename(self, source_key, target_key):
        self.require("rename")
        super().rename(source_key, target_key)


def test_a_backend_declaring_what_it_does_not_take_passes(tmp_path):
    roots = iter(range(100))
    assert_storage_contract(lambda: _KvOnly(tmp_path / f"kv{next(roots)}"))


class _RenamesAnyway(LocalStorage):
    unsupported = frozenset({"rename"})


class _DeclaresNonsense(LocalStorage):
    unsupported = frozenset({"put_file"})


class _KvButTakesAnything(LocalStorage):
    stores = "kv"


class _DeclaresMultipartWithoutIt(LocalStorage):
    capabilities = frozenset({"local_path", "multipart"})


class _DeclaresUnknownCapability(LocalStorage):
    capabilities = frozenset({"local_path", "teleport"})


@pytest.mark.parametrize(
    "broken,message",
    [
        (_ListsUnsorted, "sorted"),
        (_LosesRenames, "rename"),
        (_WrongMissingError, "rename of a missing key raised FileNotFoundError"),
        (_RenamesAnyway, "rename, declared unsupported, must raise NotSupported"),
        (_DeclaresNonsense, "not optional: \\['put_file'\\]"),
        (_KvButTakesAnything, "not a .kv artifact must raise NotSupported"),
        (_DeclaresMultipartWithoutIt, "declares multipart but refuses it"),
        (_DeclaresUnknownCapability, "unknown capabilities: \\['teleport'\\]"),
    ],
)
def test_the_storage_suite_catches_a_broken_backend(tmp_path, broken, message):
    roots = iter(range(100))
    with pytest.raises(AssertionError, match=message):
        assert_storage_contract(lambda: broken(tmp_path / f"r{next(roots)}"))


def test_the_quantizer_suite_catches_a_bound_violation():
    cls = registry.quantizer_for("int8")

    class Overpromising(cls):
        scheme = "int8-overpromising"

        def body_error_bound(self, role, x):
            return super().body_error_bound(role, x) / 100

    with pytest.raises(AssertionError, match="outside the error bound"):
        assert_quantizer_contract(Overpromising)


def test_the_quantizer_suite_catches_a_lost_residual():
    from kvcdn_quant_lowbit import Int4Quantizer

    class Forgetful(Int4Quantizer):
        scheme = "int4-forgetful"

        def dequantize(self, parts, record, dtype=None):
            return super().dequantize(parts, record, dtype) * 1.0001

    with pytest.raises(AssertionError):
        assert_quantizer_contract(Forgetful)


def test_the_quantizer_suite_catches_a_decode_that_writes_its_parts():
    """A streamed load hands ``decode`` views on the read buffer: writing them would change the file's bytes."""
    cls = registry.quantizer_for("int8")

    class InPlace(cls):
        scheme = "int8-in-place"

        def decode(self, role, parts, record):
            import torch

            out = parts[""].to(torch.float32) * parts["scale"].to(torch.float32)
            parts[""].zero_()  # the result is right, the stored codes are gone
            return out

    with pytest.raises(AssertionError, match="dequantize changed part '' in place"):
        assert_quantizer_contract(InPlace)


def test_the_quantizer_suite_catches_a_decode_that_is_not_thread_safe():
    """Decoding through state kept on the quantizer: threads see each other's tensors."""
    import threading
    import time

    cls = registry.quantizer_for("int8")

    class Stateful(cls):
        scheme = "int8-stateful"

        def decode(self, role, parts, record):
            self.codes = parts[""]
            if threading.current_thread() is not threading.main_thread():
                time.sleep(0.002)  # another worker overwrites self.codes meanwhile
            return super().decode(role, {**parts, "": self.codes}, record)

    with pytest.raises(AssertionError, match="from several threads"):
        assert_quantizer_contract(Stateful)


def test_the_quantizer_suite_catches_a_record_that_takes_a_core_name():
    """A third party's record with ``shape`` passed the suite and was written, then every load refused it."""
    cls = registry.quantizer_for("int8")

    class Shapely(cls):
        scheme = "int8-shapely"

        def encode(self, role, x):
            parts, record = super().encode(role, x)
            return parts, {**record, "shape": "per-channel"}

    with pytest.raises(KvcdnError, match="its record uses shape, which core reserves"):
        assert_quantizer_contract(Shapely)
