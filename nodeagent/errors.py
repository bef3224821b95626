"""The one exception tree of nodeagent.

    NodeAgentError                    exit 1 unless a subclass says otherwise
    ├── InputError                    exit 2: the user's input is wrong; nothing was changed
    │   ├── ConfigError               a config file (TOML/YAML) or config entry is invalid
    │   └── LabelValueError           a node label carries a value we cannot act on
    ├── OperationError                exit 1: the operation failed; nothing (or a restored state) remains
    │   ├── NvmlError                 an NVML call failed; carries the GPU and the NVML return code
    │   │   ├── NvmlNotFoundError     libnvidia-ml.so.1 could not be loaded
    │   │   ├── GpuLostError          the GPU fell off the bus
    │   │   ├── GpuBusyError          processes are using a GPU that must change
    │   │   ├── InsufficientResourcesError   a MIG instance does not fit
    │   │   ├── ResetRequiredError    the change needs a GPU reset that cannot happen here (reboot instead)
    │   │   └── NvmlPermissionError   the call needs root (NVML_ERROR_NO_PERMISSION)
    │   ├── KubeError                 the Kubernetes API failed (retryable when transient)
    │   ├── KubeletError              the kubelet device-plugin side failed
    │   ├── RuntimeConfigError        containerd / toolkit configuration could not be written
    │   └── RestartError              a service did not come back in time
    └── RebootRequired                exit 3: the change needs a host reboot to take effect

Library errors are converted at the adapter boundary with ``raise ... from e`` so the original cause
stays attached, and each error keeps the object it is about (GPU, file, node) on ``subject``.
"""

from __future__ import annotations


class NodeAgentError(Exception):
    """Base of every error nodeagent raises on purpose."""

    exit_code: int = 1
    retryable: bool = False

    def __init__(self, message: str, *, subject: str | None = None, retryable: bool | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.subject = subject
        if retryable is not None:
            self.retryable = retryable

    def __str__(self) -> str:
        return self.message


class InputError(NodeAgentError):
    """Bad input from the user or a peer; nothing was changed."""

    exit_code = 2


class ConfigError(InputError):
    """A configuration file or one of its entries is invalid."""


class LabelValueError(InputError):
    """A node label holds a value nodeagent cannot act on."""


class OperationError(NodeAgentError):
    """The operation failed; the previous state is kept or was restored."""


class NvmlError(OperationError):
    """An NVML call failed."""

    def __init__(
        self,
        message: str,
        *,
        subject: str | None = None,
        code: int | None = None,
        retryable: bool | None = None,
    ) -> None:
        super().__init__(message, subject=subject, retryable=retryable)
        self.code = code


class NvmlNotFoundError(NvmlError):
    """The NVML library is not present on this host."""


class GpuLostError(NvmlError):
    """The GPU is no longer reachable."""


class GpuBusyError(NvmlError):
    """A GPU that has to change is in use by processes."""


class InsufficientResourcesError(NvmlError):
    """A requested MIG instance does not fit on the GPU."""


class ResetRequiredError(NvmlError):
    """A change (a pending MIG mode) needs a GPU reset, and no reset is possible here (a passthrough VM,
    a driver that refuses): only a reboot makes it effective."""


class NvmlPermissionError(NvmlError):
    """NVML refused the call to an unprivileged caller (NVML_ERROR_NO_PERMISSION); it needs root."""


class KubeError(OperationError):
    """A Kubernetes API request failed; ``status`` is the HTTP status when there was one."""

    def __init__(
        self,
        message: str,
        *,
        subject: str | None = None,
        retryable: bool | None = None,
        status: int | None = None,
    ) -> None:
        super().__init__(message, subject=subject, retryable=retryable)
        self.status = status


class KubeletError(OperationError):
    """Talking to the kubelet device-plugin side failed."""


class RuntimeConfigError(OperationError):
    """The container runtime configuration could not be changed."""


class RestartError(OperationError):
    """A restarted service did not answer in time."""


class RebootRequired(NodeAgentError):
    """The change was accepted but needs a reboot to take effect."""

    exit_code = 3
