from services.memory.service import main

main()
