from services.nodeagent.agent import main

main()
