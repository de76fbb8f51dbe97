"""The DeepSpeed versions megatron_ds supports, checked at start-up before anything leans on DeepSpeed.
"""

SUPPORTED_DEEPSPEED = ">=0.19.8,<0.20"


def deepspeed_version_errors(version=None):
    """[message] when DeepSpeed `version` (default: the installed one) is outside SUPPORTED_DEEPSPEED, else []."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version
    if version is None:
        import deepspeed
        version = deepspeed.__version__
    try:
        supported = SpecifierSet(SUPPORTED_DEEPSPEED).contains(Version(version), prereleases=True)
    except InvalidVersion:
        supported = False
    if supported:
        return []
    return [f"DeepSpeed {version} is installed; megatron_ds supports deepspeed{SUPPORTED_DEEPSPEED} (it reaches "
            f"into DeepSpeed internals that change between versions): pip install 'deepspeed{SUPPORTED_DEEPSPEED}'"]


def check_deepspeed_version(version=None):
    """Raise RuntimeError naming the installed and the supported versions when they do not match."""
    errors = deepspeed_version_errors(version)
    if errors:
        raise RuntimeError(errors[0])
