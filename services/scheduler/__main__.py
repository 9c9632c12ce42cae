from gpuherd.runtime.shell import main
from services.scheduler.spec import SPEC

main(SPEC)
