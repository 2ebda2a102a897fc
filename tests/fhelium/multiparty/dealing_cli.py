"""`python -m fhelium.multiparty.dealing ARGS` as a script: test_t_of_n.py forks it from its zygote, where
fhelium is imported already, instead of starting a cold interpreter for each key.
"""

import runpy
import warnings

# The zygote imported the module already (a cold `python -m` has not): runpy warns that it runs a second
# copy as __main__, which is what a cold run does too.
warnings.filterwarnings(
    "ignore", message=r".*found in sys\.modules after import of package", category=RuntimeWarning
)
runpy.run_module("fhelium.multiparty.dealing", run_name="__main__", alter_sys=True)
