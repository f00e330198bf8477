import os
import sys

# No __main__ guard: the module body is the program, reading sys.argv directly.
name = os.environ["WWRUN_JOB_NAME"]
print(f"job={name} argv={sys.argv[1:]} argv0={os.path.basename(sys.argv[0])} joined={' '.join(sys.argv[1:])}")
print(f"main={__name__} rank={os.environ.get('RANK')} extra={os.environ.get('EXTRA')}")
