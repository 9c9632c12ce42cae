from gpuherd.runtime.shell import main
from services.memory.spec import SPEC

main(SPEC)
