from gpuherd.runtime.shell import main
from services.relay.spec import SPEC

main(SPEC)
