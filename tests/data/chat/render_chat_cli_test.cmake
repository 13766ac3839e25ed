# ctest script for `dsv4 --render-chat` (registered in server/CMakeLists.txt as dsv4_render_chat_cli):
#   cmake -DDSV4=<dsv4 binary> -DDATA=<tests/data/chat> -DWORK=<scratch folder> -P render_chat_cli_test.cmake
# Each cli/<case>.request.json must print exactly cli/<case>.expected.txt, which the official encoder
# (encoding_dsv4.py) produced from the same conversation (docs/chat-format.md). A bad request must fail naming
# the field.
file(MAKE_DIRECTORY ${WORK})
set(failures 0)
foreach(case tools_max bare_array)
  execute_process(COMMAND ${DSV4} --render-chat ${DATA}/cli/${case}.request.json
                  OUTPUT_FILE ${WORK}/${case}.out ERROR_VARIABLE err RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(SEND_ERROR "${case}: exit ${rc}: ${err}")
    math(EXPR failures "${failures} + 1")
    continue()
  endif()
  execute_process(COMMAND ${CMAKE_COMMAND} -E compare_files ${WORK}/${case}.out ${DATA}/cli/${case}.expected.txt
                  RESULT_VARIABLE differ)
  if(NOT differ EQUAL 0)
    message(SEND_ERROR "${case}: output differs from ${DATA}/cli/${case}.expected.txt (see ${WORK}/${case}.out)")
    math(EXPR failures "${failures} + 1")
  endif()
endforeach()

file(WRITE ${WORK}/bad.request.json "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}, {\"role\": \"robot\"}]}")
execute_process(COMMAND ${DSV4} --render-chat ${WORK}/bad.request.json OUTPUT_VARIABLE out ERROR_VARIABLE err
                RESULT_VARIABLE rc)
string(FIND "${err}" "messages[1].role: unknown role 'robot'" pos)
if(rc EQUAL 0 OR pos EQUAL -1)
  message(SEND_ERROR "bad request: expected a failure naming messages[1].role, got exit ${rc}: ${err}")
  math(EXPR failures "${failures} + 1")
endif()
if(failures GREATER 0)
  message(FATAL_ERROR "${failures} failure(s)")
endif()
